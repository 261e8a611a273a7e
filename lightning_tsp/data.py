"""Text data packed into fixed-length training sequences.

Byte-level tokenization by default (vocab 256, nothing to download); a local Hugging Face tokenizer directory
can be given instead. Documents are joined with an end-of-text separator and cut into ``seq_len`` windows.
With ``document_mask=True`` every window also carries packed-document ``position_ids`` (Hugging Face's
convention), so that attention and positions restart at each document.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.utils.data import Dataset

BYTE_VOCAB = 256
_BYTE_EOS = 0  # NUL never occurs in text: used as the document separator


def stdlib_text_files(limit_bytes: int = 4_000_000) -> list[Path]:
    """Python standard-library sources: real English-and-code text present offline on every machine."""
    root = Path(os.path.dirname(os.__file__))
    files, total = [], 0
    for p in sorted(root.glob("*.py")):
        files.append(p)
        total += p.stat().st_size
        if total >= limit_bytes:
            break
    if not files:
        raise FileNotFoundError(f"no .py files found under {root} (sys.prefix={sys.prefix})")
    return files


def read_documents(paths: Iterable[str | os.PathLike], text_key: str = "text") -> Iterable[str]:
    """Documents from .txt/.md/.py files (one document per file), .jsonl (one per line, field ``text_key``)
    and .parquet (column ``text_key``, needs pyarrow)."""
    for path in map(Path, paths):
        if path.is_dir():
            yield from read_documents(sorted(p for p in path.rglob("*") if p.is_file()), text_key)
        elif path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        yield json.loads(line)[text_key]
        elif path.suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError as e:
                raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from e
            yield from (str(t) for t in pq.read_table(path, columns=[text_key]).column(text_key).to_pylist())
        else:
            yield path.read_text(encoding="utf-8", errors="replace")


class PackedTextDataset(Dataset):
    """``seq_len``-token windows over the concatenated, tokenized documents: items ``{"input_ids": [S]}``.

    ``document_mask=True``: items are ``{"input_ids": [S], "position_ids": [S]}`` with the position of every
    token inside its document (Hugging Face's packed convention): 0 at the window start and on the token after
    each end-of-text token, then +1 per token. Each document ends with its end-of-text token; a document cut by
    the window boundary continues in the next window with positions restarting at 0 there. With these ids
    TSP attends within documents only and shifts the targets per document (no loss from a document's last
    token onto the next document's first).
    """

    def __init__(self, paths: Iterable[str | os.PathLike], seq_len: int, tokenizer: str | None = None,
                 text_key: str = "text", max_tokens: int | None = None, document_mask: bool = False):
        self.seq_len, self.document_mask = seq_len, document_mask
        if tokenizer is None:
            self.vocab_size = BYTE_VOCAB
            encode, eos = (lambda s: list(s.encode("utf-8"))), _BYTE_EOS
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
            self.vocab_size = len(tok)
            encode, eos = (lambda s: tok(s, add_special_tokens=False)["input_ids"]), tok.eos_token_id
            if eos is None and document_mask:
                raise ValueError(f"document_mask=True needs an end-of-text token: tokenizer {tokenizer!r} has no "
                                 f"eos_token_id")
        self.eos = eos
        ids: list[int] = []
        for doc in read_documents(paths, text_key):
            ids.extend(encode(doc))
            ids.append(eos)
            if max_tokens is not None and len(ids) >= max_tokens:
                break
        n = len(ids) // seq_len
        if n == 0:
            raise ValueError(f"the given text has {len(ids)} tokens, fewer than one sequence of seq_len={seq_len}")
        self.tokens = torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[i]
        if not self.document_mask:
            return {"input_ids": ids}
        return {"input_ids": ids, "position_ids": document_positions(ids, self.eos)}


def document_positions(ids: torch.Tensor, eos: int) -> torch.Tensor:
    """Packed position ids [S] of a window ``ids`` [S]: 0 at the window start and after every ``eos`` token,
    +1 per token inside a document."""
    idx = torch.arange(ids.shape[0])
    start = torch.zeros(ids.shape[0], dtype=torch.bool)
    start[0] = True
    start[1:] = ids[:-1] == eos
    return idx - torch.cummax(torch.where(start, idx, 0), dim=0).values
