"""``lightning-tsp generate``: text generation with a TSP model sharded over torchrun's world.

    torchrun --nproc-per-node 4 -m lightning_tsp.inference.cli ./Qwen3-dir --prompt "Hello" --max-new-tokens 32
    lightning-tsp generate checkpoints/epoch=0-step=100.ckpt --prompt-ids "1 15 27"   # a sharded TSPStrategy checkpoint
    lightning-tsp generate model.safetensors --config config.json --prompt-ids "1 15 27" --max-new-tokens 8

(``python -m lightning_tsp.inference.cli ARGS`` is ``lightning-tsp generate ARGS``.)

The kind of checkpoint is detected from the path: a Hugging Face directory (Llama, Mistral, Qwen2, Qwen3), a
directory written by ``lightning-tsp consolidate``, a sharded (DCP) checkpoint directory written by TSPStrategy,
a ``.safetensors`` file or a ``torch.save`` file (see ``lightning_tsp.inference.loading``). Without torchrun (no
WORLD_SIZE) it runs unsharded (D = 1). Rank 0 streams the tokens to stdout.
"""

from __future__ import annotations

import argparse
import codecs
import datetime
import os
import sys

import torch
import torch.distributed as dist

from lightning_tsp.checks import TSPConfigError
from lightning_tsp.group import TSPGroup
from lightning_tsp.teardown import destroy_process_groups

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-tsp generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="Hugging Face model directory, consolidated directory, sharded TSPStrategy "
                   "checkpoint directory (DCP), .safetensors file or torch.save'd full state dict")
    p.add_argument("--config", help="config.json (Hugging Face, with model_type) or tsp_config.json; default: the "
                   "configuration saved with the weights")
    p.add_argument("--preset", help="built-in model preset when there is no configuration (e.g. tiny)")
    p.add_argument("--prefix", default=None, help="attribute path of the model inside a Lightning checkpoint holding "
                   "several TSP models (default: from tsp_model.json)")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeat for a batch)")
    p.add_argument("--prompt-ids", action="append", default=[], help="prompt as space-separated token ids (repeatable)")
    p.add_argument("--tokenizer", default="auto",
                   help="'auto' (the checkpoint directory's Hugging Face tokenizer, else bytes), 'bytes', or a path")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=None, help="refuse prompt + new tokens longer than this")
    p.add_argument("--do-sample", action="store_true")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eos-token-id", type=int, default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK when available, else cpu), cpu or cuda")
    return p


class _Bytes:
    """Byte-level tokenizer (the tiny preset's vocabulary)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def streamer(self):
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return lambda ids: dec.decode(bytes(i for i in ids if i < 256))


class _HF:
    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def streamer(self):
        seen: list[int] = []
        state = {"text": ""}

        def piece(ids):
            seen.extend(ids)
            text = self.tok.decode(seen, skip_special_tokens=True)
            new, state["text"] = text[len(state["text"]):], text
            return new

        return piece


def _tokenizer(arg: str, source, vocab_size: int):
    if arg == "bytes":
        return _Bytes()
    if arg != "auto":
        return _HF(arg)
    if source.tokenizer_dir is not None:
        try:
            return _HF(source.tokenizer_dir)
        except ImportError:
            pass
    return _Bytes() if vocab_size >= 256 else None


def _setup_group(device_arg: str) -> tuple[torch.device, bool]:
    """(device, we_initialised): starts the default group when torchrun's env says so (WORLD_SIZE > 1)."""
    owns = False
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        use_cuda = torch.cuda.is_available() and device_arg != "cpu"
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=10))
        owns = True
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_arg == "auto":
        device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    elif device_arg == "cuda":
        device = torch.device(f"cuda:{local_rank}")
    else:
        device = torch.device(device_arg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device, owns


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device, owns = _setup_group(args.device)
    rc = 1
    try:
        try:
            rc = _generate(args, device)
        except TSPConfigError as e:
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"lightning-tsp generate: error: {e}", file=sys.stderr)
            rc = 2
    finally:
        if owns:  # _generate has returned: the model and its groups are no longer referenced
            destroy_process_groups(barrier=rc == 0)
    return rc


def _generate(args: argparse.Namespace, device: torch.device) -> int:
    """Load, generate, print (rank 0); every object holding a process group lives in this frame only."""
    from lightning_tsp.inference.generate import generate
    from lightning_tsp.inference.loading import load_model, resolve_checkpoint

    tsp = TSPGroup.from_process_group(dist.group.WORLD) if dist.is_initialized() else None
    rank = tsp.rank if tsp is not None else 0
    source = resolve_checkpoint(args.checkpoint, args.config, args.preset, args.prefix)
    tok = _tokenizer(args.tokenizer, source, source.cfg.vocab_size)
    prompts = [[int(t) for t in s.split()] for s in args.prompt_ids]
    if args.prompt:
        if tok is None:
            raise TSPConfigError("no tokenizer for text prompts: pass --prompt-ids or --tokenizer PATH")
        prompts += [tok.encode(t) for t in args.prompt]
    if not prompts:
        raise TSPConfigError("no prompt: pass --prompt TEXT or --prompt-ids 'ID ID ...'")
    model = load_model(source, tsp, DTYPES[args.dtype], device)
    check_runtime = getattr(model, "_check_runtime", None)  # TSPCausalLM: e.g. a sliding window too short
    if check_runtime is not None:
        check_runtime(max(map(len, prompts)) + args.max_new_tokens - 1)  # the last new token is not fed back

    as_text = tok is not None and not args.prompt_ids
    pieces = tok.streamer() if as_text else None
    stream = rank == 0 and len(prompts) == 1

    def streamer(step, tokens):
        if stream:
            ids = tokens.tolist()
            sys.stdout.write(pieces(ids) if as_text else ("" if step == 0 else " ") + str(ids[0]))
            sys.stdout.flush()

    out = generate(model, prompts, args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_token_id=args.eos_token_id,
                   max_seq_len=args.max_seq_len, streamer=streamer)
    if rank == 0:
        if stream:
            sys.stdout.write("\n")
        else:
            for i in range(len(prompts)):
                ids = out.tokens[i, : out.lengths[i]].tolist()
                text = tok.streamer()(ids) if as_text else " ".join(map(str, ids))
                sys.stdout.write(f"[{i}] {text}\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
