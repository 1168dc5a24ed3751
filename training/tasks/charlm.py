"""A small GPT-style character language model (after nanoGPT's shakespeare_char): AdamW, warmup
then cosine learning rate, gradient clipping, dropout, and an evaluation every N steps with the
validation loss and a sampled line of text. Mixed precision is the loop's (``--precision``).

One file written only against ``training.api``. Its dropout masks come from
``keyed_dropout``, keyed by (seed, step, sample index), so they are the same at any world size
and after any resume; the scheduler is handed to the loop, which keeps its state. Its loss is
a (sum, count) pair over the characters it predicts: the loop averages it over the global
batch's count, so padding counts for nothing.

The corpus is one UTF-8 text file, ``input.txt`` in ``--data-dir`` (Tiny Shakespeare by
default, staged like CIFAR-10: its URL and SHA-256 are stack config). The first 90% trains,
the rest validates; a sample is a window of ``block_size + 1`` characters at a multiple of
``block_size``. With ``--line-ends`` a training sample stops at its window's last line break:
samples of variable length, padded in the batch, the padding left out of the loss.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from training.api import (
    EMA,
    BuildContext,
    Data,
    EvalContext,
    Evaluation,
    MicroBatch,
    ParallelContext,
    TrainParts,
    TrainSpec,
    keyed_dropout,
    keyed_seed,
    require_at_least,
)
from training.data.sources import CORPUS_FILE

TRAIN_FRACTION = 0.9
DROPOUT_STREAM = 1
SAMPLE_STREAM = 2


@dataclass
class CharLMOptions:
    block_size: int = 64
    """Characters of context per sample."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    n_embd: int = 128
    """Width of the residual stream (a multiple of --n-head)."""
    dropout: float = 0.1
    """Dropout after the embeddings, each attention and each MLP (0 = off)."""
    weight_decay: float = 0.1
    """AdamW weight decay of the matrices (not of biases and norms)."""
    warmup_steps: int = 100
    """Steps of linear warmup to --lr, then a cosine decay to --min-lr-ratio x --lr."""
    decay_steps: int = 5000
    """The step at which the cosine decay reaches its floor (and stays)."""
    min_lr_ratio: float = 0.1
    """The cosine decay's floor, as a fraction of --lr."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    eval_chunks: int = 64
    """Validation windows per evaluation, split over the ranks."""
    sample_chars: int = 80
    """Characters sampled for the log at each evaluation (at most one line)."""
    line_ends: bool = False
    """A training sample stops at the last line break of its window (the whole window when
    it has none): variable lengths, padded, the padding not counted in the loss."""
    ema_decay: float = 0.0
    """Keep an exponential moving average of the parameters with this decay, saved and
    restored with them (0 = none)."""


class CharChunks:
    """Windows of ``block_size + 1`` token ids at multiples of ``block_size``; cut after
    their last ``line_end`` token when one is given."""

    def __init__(
        self, tokens: torch.Tensor, block_size: int, digest: str, line_end: int | None = None
    ) -> None:
        self.tokens, self.block_size, self._digest = tokens, block_size, digest
        self.line_end = line_end

    def __len__(self) -> int:
        return max((len(self.tokens) - 1) // self.block_size, 0)

    def __getitem__(self, index: int) -> torch.Tensor:
        start = int(index) * self.block_size
        window = self.tokens[start : start + self.block_size + 1]
        if self.line_end is None:
            return window
        # Targets are window[1:]: keep up to the last one that ends a line.
        ends = (window[1:] == self.line_end).nonzero()
        return window[: int(ends[-1]) + 2] if len(ends) else window

    @property
    def digest(self) -> str:
        return self._digest


@dataclass(frozen=True)
class Corpus(Data):
    vocabulary: str = ""
    """Every character of the corpus, sorted: token id i is ``vocabulary[i]``."""


def load_data(data_dir: str, options: CharLMOptions) -> Corpus:
    """``input.txt`` in ``data_dir``, split 90/10 into training and validation windows."""
    path = Path(data_dir) / CORPUS_FILE
    try:
        raw = path.read_bytes()
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text ({exc}): is it the staged corpus?") from None
    vocabulary = "".join(sorted(set(text)))
    lookup = {c: i for i, c in enumerate(vocabulary)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.int64)
    split = int(len(ids) * TRAIN_FRACTION)
    digest = hashlib.sha256(raw).hexdigest()
    line_end = lookup.get("\n") if options.line_ends else None
    name = f"{digest}:train:{options.block_size}" + (":lines" if line_end is not None else "")
    train = CharChunks(ids[:split], options.block_size, name, line_end)
    validation = CharChunks(ids[split:], options.block_size, f"{digest}:val")
    if len(validation) == 0:
        raise ValueError(
            f"{path} has {len(text)} characters: too few for one validation window of "
            f"--block-size {options.block_size} + 1 in its last {1 - TRAIN_FRACTION:.0%}"
        )
    return Corpus(train=train, validation=validation, vocabulary=vocabulary)


def check(options: CharLMOptions) -> None:
    require_at_least(options, 1, "block_size", "n_layer", "n_head", "n_embd", "eval_chunks")
    require_at_least(options, 0, "warmup_steps", "grad_clip", "sample_chars")
    if options.n_embd % options.n_head:
        raise ValueError(
            f"--n-embd ({options.n_embd}) must be a multiple of --n-head ({options.n_head})"
        )
    if not 0.0 <= options.dropout < 1.0:
        raise ValueError(f"--dropout must be in [0, 1), got {options.dropout}")
    if options.decay_steps < options.warmup_steps:
        raise ValueError(
            f"--decay-steps ({options.decay_steps}) must be >= --warmup-steps "
            f"({options.warmup_steps})"
        )
    if not 0.0 <= options.ema_decay < 1.0:
        raise ValueError(f"--ema-decay must be in [0, 1), got {options.ema_decay}")
    if not 0.0 <= options.min_lr_ratio <= 1.0:
        raise ValueError(f"--min-lr-ratio must be in [0, 1], got {options.min_lr_ratio}")


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, options: CharLMOptions, index: int) -> None:
        super().__init__()
        width = options.n_embd
        self.n_head, self.p, self.index = options.n_head, options.dropout, index
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, seeds: torch.Tensor | None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # no attention dropout
        y = self.proj(y.transpose(1, 2).reshape(b, t, c))
        x = x + _dropout(y, self.p, seeds, 2 * self.index + 1)
        y = self.out(F.gelu(self.fc(self.norm2(x))))
        return x + _dropout(y, self.p, seeds, 2 * self.index + 2)


def _dropout(x: torch.Tensor, p: float, seeds: torch.Tensor | None, site: int) -> torch.Tensor:
    return keyed_dropout(x, p, seeds, site) if seeds is not None else x


class CharGPT(nn.Module):
    """Token and position embeddings, transformer blocks, a tied linear head."""

    def __init__(self, options: CharLMOptions, vocab_size: int) -> None:
        super().__init__()
        self.block_size, self.p = options.block_size, options.dropout
        self.tokens = nn.Embedding(vocab_size, options.n_embd)
        self.positions = nn.Embedding(options.block_size, options.n_embd)
        self.blocks = nn.ModuleList(Block(options, i) for i in range(options.n_layer))
        self.norm = nn.LayerNorm(options.n_embd)
        self.head = nn.Linear(options.n_embd, vocab_size, bias=False)
        self.head.weight = self.tokens.weight  # weight tying, as in GPT-2
        init_weights(self)

    def forward(self, idx: torch.Tensor, seeds: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for each position; ``seeds`` (one per sample) turn dropout on."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = _dropout(self.tokens(idx) + self.positions(positions), self.p, seeds, 0)
        for block in self.blocks:
            x = block(x, seeds)
        return self.head(self.norm(x))


def init_weights(model: nn.Module) -> None:
    """Every parameter (the model has no buffers): the matrices and embeddings N(0, 0.02),
    the biases 0, the norms as built. Sets the norms too: a sharded model is materialized
    uninitialized (``--parallelism fsdp2``)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)


def parallelize(model: nn.Module, ctx: ParallelContext) -> None:
    """FSDP2: each block one unit, then the root, whose unit holds the embeddings, the final
    norm and the head, tied to the token embedding: one parameter, gathered once."""
    assert isinstance(model, CharGPT)
    for block in model.blocks:
        fully_shard(block, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)


def warmup_cosine(warmup: int, total: int, floor: float) -> Any:
    """The LR factor at step s: linear warmup over ``warmup`` steps, then cosine to ``floor``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build(options: CharLMOptions, data: Corpus, run: BuildContext) -> TrainParts:
    model = CharGPT(options, len(data.vocabulary))
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": options.weight_decay}, {"params": others}],
        lr=run.lr,
        betas=(0.9, 0.95),
        weight_decay=0.0,
    )
    schedule = warmup_cosine(options.warmup_steps, options.decay_steps, options.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    extras = {"ema": EMA(options.ema_decay)} if options.ema_decay else {}
    return TrainParts(model, optimizer, scheduler, options.grad_clip or None, extras)


def collate(items: Sequence[torch.Tensor], where: MicroBatch) -> dict[str, torch.Tensor]:
    """The windows padded to the longest one's length, with each one's length."""
    lengths = torch.tensor([len(item) for item in items])
    windows = torch.zeros(len(items), int(lengths.max()), dtype=torch.int64)
    for row, item in zip(windows, items, strict=True):
        row[: len(item)] = item
    return {"windows": windows, "lengths": lengths}


def _char_losses(model: nn.Module, windows: torch.Tensor, seeds: Any = None) -> torch.Tensor:
    """The next-character loss at each position (attention is causal: the padding after a
    window's end changes none of its own positions)."""
    x, y = windows[:, :-1], windows[:, 1:]
    logits = model(x, seeds)  # cross_entropy is float32 under autocast
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none")


def loss(
    model: nn.Module, batch: dict[str, torch.Tensor], where: MicroBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of the predicted characters' losses, and their count (no padding)."""
    losses = _char_losses(model, batch["windows"], where.sample_seeds(DROPOUT_STREAM))
    positions = torch.arange(losses.shape[1], device=losses.device)
    counted = positions < (batch["lengths"] - 1).unsqueeze(1)
    return (losses * counted).sum(), counted.sum()


def evaluate(model: nn.Module, data: Corpus, ctx: EvalContext) -> Evaluation:
    """The validation loss of this rank's share of the first windows; rank 0 samples a line."""
    assert data.validation is not None
    options: CharLMOptions = ctx.options
    share = ctx.share(min(options.eval_chunks, len(data.validation)))
    windows = [data.validation[i] for i in share]
    loss_sum = 0.0
    if windows:
        loss_sum = float(_char_losses(model, torch.stack(windows).to(ctx.device)).mean(1).sum())
    # Every rank samples the same line (keyed by the step): a sharded model's forward is a
    # collective. Rank 0's is logged.
    text = sample_line(model, data, ctx, options.sample_chars)
    return Evaluation(loss_sum, len(windows), text if ctx.rank == 0 else None)


def sample_line(model: nn.Module, data: Corpus, ctx: EvalContext, chars: int = 80) -> str:
    """Characters sampled after a newline, up to the next one; randomness keyed by the step."""
    generator = torch.Generator(device=ctx.device)
    generator.manual_seed(keyed_seed((ctx.seed, SAMPLE_STREAM, ctx.step)))
    newline = data.vocabulary.find("\n")
    idx = torch.tensor([[max(newline, 0)]], device=ctx.device)
    out = []
    for _ in range(chars):
        logits = model(idx[:, -model.block_size :])[:, -1].float()  # softmax to sample from
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        char = data.vocabulary[int(nxt)]
        if char == "\n":
            break
        out.append(char)
        idx = torch.cat([idx, nxt], dim=1)
    return "".join(out)


SPEC = TrainSpec(
    name="charlm",
    options=CharLMOptions,
    load_data=load_data,
    build=build,
    collate=collate,
    loss=loss,
    evaluate=evaluate,
    check=check,
    parallelize=parallelize,
    init_weights=init_weights,
    defaults={"lr": 1e-3, "global_batch_size": 32, "micro_batch_size": 16, "eval_every": 50},
    # The parameters' shapes, and the windows a sample index means: the rest may change.
    state_options=("block_size", "n_layer", "n_head", "n_embd", "line_ends"),
)
