"""Codecs: how a float vector becomes the bytes a compressed all_reduce sends, and back.

Each method is a frozen dataclass that says what it is (its parameters and the header
word that names it on the wire) and encodes rows of equal length at once. The rows of a
``(rows, length)`` tensor in the working dtype (the first ``valid[r]`` elements of row
``r`` are the tensor's, the rest zeros that pad it) become the rows of a
``(rows, nbytes)`` uint8 payload, and decoding turns payload rows back into values.
Encoding also gives what each element lost, which is what the receiver will not see, so
the sender's error feedback keeps exactly that. CPU tensors go through the extension's
one-pass kernels, other devices through the same codecs written in torch ops.

A block that holds an infinity or a NaN decodes to NaN on every element (its scale is
sent as NaN), so the sum is NaN there, as an uncompressed sum would be, and a loss
scaler that watches for non-finite gradients sees it. The sender's error feedback keeps
nothing of such a block: one overflow must not poison every later step.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from .. import _C

__all__ = ["Int8", "Sign", "TopK", "Method", "as_dtype", "describe_word"]

# Method kinds in the header word (bits 56..63); the parameter is in bits 0..31 and the
# working dtype in bits 32..39.
_INT8, _SIGN, _TOPK = 1, 2, 3
_WDTYPES = {torch.float32: 1, torch.float64: 2}
_WDTYPE_NAMES = {1: "float32", 2: "float64"}


def _check_block(block: object, name: str) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= 2**24:
        raise ValueError(f"{name}: block must be an int from 1 to 2**24 elements, not "
                         f"{block!r}; 256 is a good default")


class _BlockCodec:
    """What Int8 and Sign share: encoding into payload rows and decoding them, through
    the extension's one-pass CPU kernels (csrc/kernels/quantize_cpu.cpp) for CPU tensors
    and through ``encode``/``decode``, the same codec in torch ops, elsewhere (CUDA).
    Int8's two paths give the same bits; Sign's scales may differ in the last bit (their
    sums add in another order), which no rank sees: each payload is decoded as sent."""

    block: int
    kernel = ""  # the extension's name for it
    _kind = 0  # the header word's method kind

    def __post_init__(self) -> None:
        _check_block(self.block, type(self).__name__)

    def word(self, wdtype: torch.dtype) -> int:
        return (self._kind << 56) | (_WDTYPES[wdtype] << 32) | self.block

    def encode(self, rows: torch.Tensor, valid: list[int],
               ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, length: int, wdtype: torch.dtype,
               ) -> torch.Tensor:
        raise NotImplementedError

    def encode_into(self, rows: torch.Tensor, valid: list[int], out: torch.Tensor,
                    lost: torch.Tensor | None) -> None:
        """Encodes ``rows`` into ``out`` (uint8, a row each, as ``nbytes`` says), and
        into ``lost`` (rows' shape, when given) what each element lost: 0 in blocks that
        are not finite. ``lost`` may be the memory ``rows`` was summed from."""
        if rows.device.type == "cpu":
            _C._codec_encode(self.kernel, rows, self.block, valid, out, lost)
            return
        payload, decoded = self.encode(rows, valid)
        out.copy_(payload)
        if lost is not None:
            torch.sub(rows, decoded, out=lost)
            lost.masked_fill_(~torch.isfinite(lost), 0)

    def decode_rows(self, payload: torch.Tensor, length: int, wdtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """The ``(rows, length)`` values that ``payload``'s rows encode (into ``out``
        when given)."""
        if out is None:
            out = torch.empty(payload.shape[0], length, dtype=wdtype, device=payload.device)
        if payload.device.type == "cpu":
            _C._codec_decode(self.kernel, payload, length, self.block, out, False)
        else:
            out.copy_(self.decode(payload, length, wdtype))
        return out

    def decode_sum(self, payload: torch.Tensor, length: int, wdtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """The sum of the values ``payload``'s rows encode, added in row order (into
        ``out`` when given)."""
        if out is None:
            out = torch.empty(length, dtype=wdtype, device=payload.device)
        if payload.device.type == "cpu":
            _C._codec_decode(self.kernel, payload, length, self.block, out, True)
            return out
        rows = self.decode(payload, length, wdtype)
        out.copy_(rows[0])
        for r in range(1, rows.shape[0]):
            out += rows[r]
        return out


@dataclass(frozen=True)
class Int8(_BlockCodec):
    """Block-scaled int8: each block of ``block`` elements travels as int8 values ``q``
    and one scale ``s = max|x| / 127``, and decodes as ``q * s``. The error of each
    element is at most ``s / 2``, that is ``max|x| / 254`` over its block. Bytes per
    element: ``1 + itemsize / block`` (about 1.02 at the default, a quarter of float32)."""

    block: int = 256
    kernel = "int8"
    _kind = _INT8

    @property
    def unit(self) -> int:
        return self.block

    def nbytes(self, length: int, wdtype: torch.dtype) -> int:
        return length + (length // self.block) * wdtype.itemsize

    def encode(self, rows: torch.Tensor, valid: list[int],
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Torch ops: the payload rows and what they decode to."""
        n, length = rows.shape
        blocks = rows.reshape(-1, self.block)
        amax = blocks.abs().amax(1, keepdim=True)
        finite = torch.isfinite(amax)
        scale = amax / 127
        usable = finite & (scale > 0)
        q = torch.round(blocks / torch.where(usable, scale, torch.ones_like(scale)))
        q = q.clamp_(-127, 127).masked_fill_(~usable, 0).to(torch.int8)
        scale = scale.masked_fill(~finite, math.nan)
        decoded = (q.to(rows.dtype) * scale).reshape(n, length)
        payload = torch.cat([q.reshape(n, length).view(torch.uint8),
                             scale.reshape(n, -1).view(torch.uint8)], dim=1)
        return payload, decoded

    def decode(self, payload: torch.Tensor, length: int, wdtype: torch.dtype) -> torch.Tensor:
        n = payload.shape[0]
        q = payload[:, :length].view(torch.int8)
        scale = as_dtype(payload[:, length:], wdtype)
        return (q.to(wdtype).reshape(-1, self.block) * scale.reshape(-1, 1)).reshape(n, length)


@dataclass(frozen=True)
class Sign(_BlockCodec):
    """One bit per element with a scale per block (signSGD with a scale): each block of
    ``block`` elements travels as its signs and ``s = mean|x|`` and decodes as ``+s`` or
    ``-s``, the nearest such vector to the block. Lossy well beyond int8: use it with
    error feedback, which carries what each step loses into the next. Bytes per element:
    ``1/8 + itemsize / block`` (about 0.14 at the default, 1/29 of float32)."""

    block: int = 256
    kernel = "sign"
    _kind = _SIGN

    @property
    def unit(self) -> int:
        return math.lcm(self.block, 8)

    def nbytes(self, length: int, wdtype: torch.dtype) -> int:
        return length // 8 + (length // self.block) * wdtype.itemsize

    def encode(self, rows: torch.Tensor, valid: list[int],
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Torch ops: the payload rows and what they decode to."""
        n, length = rows.shape
        blocks = rows.reshape(-1, self.block)
        # The mean over the block's elements of the tensor, not over the zeros that pad
        # the last one: those would shrink the scale of a short tail block.
        starts = torch.arange(0, length, self.block, device=rows.device)
        counts = (torch.tensor(valid, device=rows.device).unsqueeze(1) - starts)
        counts = counts.clamp_(1, self.block).reshape(-1, 1).to(rows.dtype)
        scale = blocks.abs().sum(1, keepdim=True) / counts
        scale = scale.masked_fill(~torch.isfinite(scale), math.nan)
        positive = blocks >= 0
        decoded = torch.where(positive, scale, -scale).reshape(n, length)
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8,
                               device=rows.device)
        bits = (positive.reshape(-1, 8).to(torch.uint8) * weights).sum(1, dtype=torch.uint8)
        payload = torch.cat([bits.reshape(n, length // 8),
                             scale.reshape(n, -1).view(torch.uint8)], dim=1)
        return payload, decoded

    def decode(self, payload: torch.Tensor, length: int, wdtype: torch.dtype) -> torch.Tensor:
        n = payload.shape[0]
        packed = payload[:, :length // 8]
        shifts = torch.arange(8, dtype=torch.uint8, device=payload.device)
        positive = ((packed.unsqueeze(-1) >> shifts) & 1).bool().reshape(-1, self.block)
        scale = as_dtype(payload[:, length // 8:], wdtype).reshape(-1, 1)
        return torch.where(positive, scale, -scale).reshape(n, length)


@dataclass(frozen=True)
class TopK:
    """The ``ratio`` share of elements largest in magnitude (at least one), sent as
    values and indices; the rest count as zero. Every rank's selection is gathered and
    summed, so the result holds up to ``world * k`` nonzeros. With error feedback the
    elements left out accumulate until they are large enough to be sent. Bytes per
    element: ``ratio * (itemsize + 4)`` (8 for tensors of 2**31 elements or more), sent
    to every rank."""

    ratio: float = 0.01

    def __post_init__(self) -> None:
        r = self.ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
            raise ValueError(f"TopK: ratio must be a number in (0, 1], not {r!r}; "
                             "0.01 sends 1% of the elements")

    @property
    def unit(self) -> int:
        return 1

    def word(self, wdtype: torch.dtype) -> int:
        bits = struct.unpack("<I", struct.pack("<f", float(self.ratio)))[0]
        return (_TOPK << 56) | (_WDTYPES[wdtype] << 32) | bits

    def k(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    @staticmethod
    def index_dtype(numel: int) -> torch.dtype:
        return torch.int32 if numel < 2**31 else torch.int64


Method = Int8 | Sign | TopK


def describe_word(word: int) -> str:
    """The method a header word names, for an error that quotes another rank's call."""
    kind, wd, param = word >> 56, (word >> 32) & 0xFF, word & 0xFFFFFFFF
    dtype = _WDTYPE_NAMES.get(wd, f"dtype code {wd}")
    if kind == _INT8:
        return f"Int8(block={param}) in {dtype}"
    if kind == _SIGN:
        return f"Sign(block={param}) in {dtype}"
    if kind == _TOPK:
        ratio = struct.unpack("<f", struct.pack("<I", param))[0]
        return f"TopK(ratio={ratio:.6g}) in {dtype}"
    return f"an unknown method (header word {word:#x})"


def as_dtype(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes of ``raw`` (uint8, any strides) read as a flat tensor of ``dtype``: copied
    first, since a slice of a payload row need not be aligned or contiguous for the view."""
    return raw.reshape(-1).clone().view(dtype)
