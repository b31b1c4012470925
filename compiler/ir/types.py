"""Element types and tensor types of the IR. Shapes mix static ints and symbolic dims (str)."""

from __future__ import annotations

import builtins
import enum
from dataclasses import dataclass

import numpy as np
import torch
from torch import dtype as TorchDType  # noqa: N812  (the `torch` property shadows the module in the class)

Dim = int | str  # int: static extent; str: symbolic ("batch", "seq", "past", ...)


class DType(enum.Enum):
    f32 = "f32"
    f16 = "f16"
    bf16 = "bf16"
    f64 = "f64"
    i64 = "i64"
    i32 = "i32"
    i16 = "i16"
    i8 = "i8"
    u8 = "u8"
    bool = "bool"

    @property
    def is_float(self) -> builtins.bool:  # `bool` is a member name in this class
        return self in (DType.f32, DType.f16, DType.bf16, DType.f64)

    @property
    def torch(self) -> TorchDType:
        return _TORCH[self]

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype; KeyError for bf16, which numpy lacks (such data is a torch tensor)."""
        return _NUMPY[self]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch).element_size()

    @staticmethod
    def from_torch(dt: TorchDType) -> DType:
        for k, v in _TORCH.items():
            if v == dt:
                return k
        raise ValueError(f"no IR dtype for torch dtype {dt}")

    @staticmethod
    def from_numpy(dt: np.dtype) -> DType:
        key = np.dtype(dt)
        for k, v in _NUMPY.items():
            if v == key:
                return k
        if key.name == "bfloat16":
            return DType.bf16
        raise ValueError(f"no IR dtype for numpy dtype {dt}")


_TORCH = {
    DType.f32: torch.float32, DType.f16: torch.float16, DType.bf16: torch.bfloat16,
    DType.f64: torch.float64, DType.i64: torch.int64, DType.i32: torch.int32,
    DType.i16: torch.int16, DType.i8: torch.int8, DType.u8: torch.uint8, DType.bool: torch.bool,
}
_NUMPY: dict[DType, np.dtype] = {
    DType.f32: np.dtype(np.float32), DType.f16: np.dtype(np.float16), DType.f64: np.dtype(np.float64),
    DType.i64: np.dtype(np.int64), DType.i32: np.dtype(np.int32), DType.i16: np.dtype(np.int16),
    DType.i8: np.dtype(np.int8), DType.u8: np.dtype(np.uint8), DType.bool: np.dtype(np.bool_),
}


@dataclass(frozen=True)
class TensorType:
    """dtype plus shape; shape None means the rank is unknown."""

    dtype: DType
    shape: tuple[Dim, ...] | None

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    @property
    def is_static(self) -> bool:
        return self.shape is not None and all(isinstance(d, int) for d in self.shape)

    def numel(self) -> int | None:
        if not self.is_static:
            return None
        n = 1
        for d in self.shape or ():
            n *= int(d)
        return n

    def __str__(self) -> str:
        if self.shape is None:
            return f"{self.dtype.value}[*]"
        return f"{self.dtype.value}[{', '.join(str(d) for d in self.shape)}]"
