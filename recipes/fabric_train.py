"""Train the tiny TSP model with Lightning Fabric on CPU processes: ``Fabric(strategy="tsp")``.

    python recipes/fabric_train.py                      # 2 processes, D = 2, 50 steps, Python's own source text
    python recipes/fabric_train.py --devices 4 --tsp-size 2 --steps 20 --save runs/fabric-ckpt
    torchrun --nproc-per-node 2 recipes/fabric_train.py # the same under torchrun (Fabric launches nothing then)

``fabric.launch()`` re-runs this script for the other ranks (Lightning's subprocess launcher). The data is
``TextDataModule``'s (byte tokens of the standard library, packed into ``seq_len`` windows); each rank holds half of
every weight and half of every sequence, and the printed loss (identical on every rank) falls. ``--save`` writes a
sharded checkpoint in the Trainer's layout (``lightning-tsp consolidate`` reads it; ``Trainer.fit(ckpt_path=...)``
/ ``validate`` load its weights into a LightningModule that holds the model as ``self.model``).
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.utils.data import DataLoader, DistributedSampler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tsp-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "bf16-true"])
    parser.add_argument("--max-tokens", type=int, default=400_000)
    parser.add_argument("--save", default=None, help="write a sharded checkpoint directory at the end")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from lightning.fabric import Fabric

    import lightning_tsp  # noqa: F401  (registers strategy="tsp" for the Trainer and Fabric)
    from lightning_tsp import TSPLlama, get_config
    from lightning_tsp.datamodule import TextDataModule
    from lightning_tsp.fabric import TSPFabricStrategy

    fabric = Fabric(strategy=TSPFabricStrategy(tsp_size=args.tsp_size, process_group_backend="gloo"),
                    accelerator="cpu", devices=args.devices, precision=args.precision)
    fabric.launch()
    fabric.seed_everything(0)

    data = TextDataModule(source="stdlib", seq_len=args.seq_len, batch_size=args.batch_size,
                          max_tokens=args.max_tokens, val_fraction=0.0)
    data.setup("fit")
    # every rank of a TSP group reads the same samples: split over the data-parallel axis only
    sampler = DistributedSampler(data.train_set, shuffle=True, seed=0, **fabric.strategy.distributed_sampler_kwargs)
    loader = fabric.setup_dataloaders(DataLoader(data.train_set, batch_size=args.batch_size, sampler=sampler,
                                                 drop_last=True), use_distributed_sampler=False)

    # unsharded on the meta device: the strategy initialises only this rank's shards (same weights whatever D)
    model = fabric.setup_module(TSPLlama(get_config("tiny"), device="meta"))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1))

    step = 0
    while step < args.steps:
        for batch in loader:
            batch = fabric.strategy.batch_to_device(batch)  # this rank's zigzag slice + the global token count
            loss = model(**batch)                           # global token-mean loss (the same on every TSP rank)
            fabric.backward(loss)                           # + the data-parallel gradient average
            norm = fabric.clip_gradients(model, optimizer, max_norm=args.clip)  # the exact global norm
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == 1 or step % 10 == 0 or step == args.steps:
                # `loss` is the replica's share of the global mean: average over ranks for the global value
                value = fabric.all_reduce(loss.detach(), reduce_op="mean")
                fabric.print(f"step {step:4d}/{args.steps}  loss {float(value):.4f}  grad norm {float(norm):.3f}")
            if step == args.steps:
                break
    if args.save:
        fabric.save(args.save, {"model": model, "optimizer": optimizer, "step": step})
        fabric.print(f"saved {args.save}")


if __name__ == "__main__":
    main()
