"""``--deterministic``: the same inputs give the same bits, run after run.

Exact resume holds without it: the state saved is the state restored, to the bit. What it adds
is that the *trajectory after* a resume repeats the uninterrupted one, at the same world size,
instead of drifting apart at rounding level. Without it, on a GPU, cuDNN may pick kernels that
reduce in a varying order (atomics), and convolutions run in TF32 by default in torch 2.13
(``torch.backends.cudnn.conv.fp32_precision == "tf32"``), so two runs, or a run and its resume,
differ after the first step. The settings (PyTorch's notes "Reproducibility" and "TensorFloat-32
(TF32) on Ampere and later devices", torch 2.13):

- ``torch.use_deterministic_algorithms(True)``: an op without a deterministic implementation
  raises instead of running nondeterministically;
- ``torch.backends.cudnn.deterministic = True`` and ``benchmark = False``: cuDNN's algorithm
  is chosen the same way every time;
- TF32 off through the ``fp32_precision`` API (``"ieee"`` for matmul, cuDNN conv and RNN):
  mixing it with the legacy ``allow_tf32`` flags is refused by torch;
- ``CUBLAS_WORKSPACE_CONFIG=:4096:8``: cuBLAS needs it for deterministic results on CUDA >=
  10.2, and reads it when CUDA initialises, so this runs before the worker picks its device.

Across world sizes nothing makes runs bitwise equal: the all-reduce sums the ranks' gradients
in another order. In float64 on CPU they agree to about 1e-15 (``--dtype float64``).
"""

from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_WORKSPACE = ":4096:8"
_CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")
"""The two values cuBLAS documents as deterministic; a user's choice of either is kept."""


def use_deterministic_algorithms() -> dict[str, object]:
    """Apply the settings above (before CUDA is initialised); what is now in effect."""
    if os.environ.get(CUBLAS_WORKSPACE_ENV) not in _CUBLAS_DETERMINISTIC:
        os.environ[CUBLAS_WORKSPACE_ENV] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    torch.backends.cudnn.rnn.fp32_precision = "ieee"
    return settings()


def settings() -> dict[str, object]:
    """The determinism settings in effect, for the start-up log."""
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "matmul_fp32_precision": torch.backends.cuda.matmul.fp32_precision,
        "cudnn_conv_fp32_precision": torch.backends.cudnn.conv.fp32_precision,
        CUBLAS_WORKSPACE_ENV: os.environ.get(CUBLAS_WORKSPACE_ENV),
    }
