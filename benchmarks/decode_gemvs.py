"""The weight products of one decode step, on one GPU: cuBLAS against the compiled reductions of
``lightning_tsp.kernels.gemv`` (Inductor's default heuristics and its coordinate-descent tuning).

paper-7b as rank 0 of D = 8: per layer q, k, v [512, 4096], o_proj's columns [4096, 512], gate and up [2048, 4096]
(with their SwiGLU), down [4096, 2048]; 32 layers captured in one CUDA graph (as the decoder replays them), median
of 20 replays, and the weight bytes over that time.

    python -m benchmarks.decode_gemvs
"""

from __future__ import annotations

import torch


def main() -> None:
    import torch._inductor.config as inductor_config

    from benchmarks.decode_kernels import bench
    from lightning_tsp.kernels import gemv
    from lightning_tsp.kernels.gemm import matmul_into

    dev, bf = "cuda", torch.bfloat16
    shapes = dict(q=(512, 4096), k=(512, 4096), v=(512, 4096), o=(4096, 512), g=(2048, 4096), u=(2048, 4096),
                  d=(4096, 2048))
    layers = [{n: torch.randn(*s, device=dev, dtype=bf) for n, s in shapes.items()} for _ in range(32)]
    nbytes = sum(w.numel() * 2 for layer in layers for w in layer.values())
    print(torch.cuda.get_device_name())
    for rows in (1, 4):
        x, xo, xd = (torch.randn(rows, k, device=dev, dtype=bf) for k in (4096, 512, 2048))
        for variant in ("cublas", "default", "coordinate-descent"):
            if variant == "cublas":
                def step():
                    for w in layers:
                        x @ w["q"].T, x @ w["k"].T, x @ w["v"].T
                        matmul_into(x.new_empty(rows, 4096, dtype=torch.float32), xo, w["o"].T)
                        gemv._swiglu(x @ w["g"].T, x @ w["u"].T)  # what decoding ran before
                        matmul_into(x.new_empty(rows, 4096, dtype=torch.float32), xd, w["d"].T)
            else:
                gemv.MAX_ROWS = rows  # the reduction path at this row count
                inductor_config.coordinate_descent_tuning = variant == "coordinate-descent"
                torch._dynamo.reset()

                def step():
                    for w in layers:
                        gemv.linear_rows(x, w["q"]), gemv.linear_rows(x, w["k"]), gemv.linear_rows(x, w["v"])
                        gemv.linear_rows(xo, w["o"], out_dtype=torch.float32)
                        gemv.swiglu_rows(x, w["g"], w["u"])
                        gemv.linear_rows(xd, w["d"], out_dtype=torch.float32)
            step()
            step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            t = bench(graph.replay) * 1e3  # ms
            print(f"rows={rows} {variant}: {t:.3f} ms for {nbytes / 1e9:.2f} GB of weights "
                  f"({nbytes / t / 1e6:.0f} GB/s)", flush=True)


if __name__ == "__main__":
    main()
