"""The storage precisions of an embedding table's rows, by the names configs, checkpoints and
serving artifacts use: defined once here, for training (``table_precision``, which imports
torchrec) and serving (``serving.manifest``, whose runtime imports no torchrec)."""

from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16,
                                        "bf16": torch.bfloat16}
"""A table's precision name -> the dtype its rows are stored in (in training, in checkpoints
and in an unquantized serving artifact)."""

DTYPE_NAMES: dict[torch.dtype, str] = {d: name for name, d in TORCH_DTYPES.items()}
"""The other way: a stored dtype -> its precision name."""
