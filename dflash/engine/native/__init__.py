"""The C++ decode-layer loop (decode_layers.cpp): built by `make install` (so by `make serve` and
`make test`) with the machine's compiler, loaded if present, else the model runs its Python path.

    .venv/bin/python -m dflash.engine.native     # build (about a minute); prints where it went

It runs only decode steps and verification blocks (few rows), where per-call overhead is most of a
step; prefill chunks stay in Python. `DFLASH_NATIVE=0` turns it off (benches compare both).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import structlog
import torch

log = structlog.get_logger("dflash.native")

SOURCES = [Path(__file__).with_name(name) for name in ("decode_layers.cpp", "quantized_linear.cpp", "causal_attention.cpp", "logits.cpp", "step_pool.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("step_pool.h", "amx_tiles.h", "tree_chain.h")]
BUILD_DIR = Path(__file__).with_name("build")
NAME = "dflash_decode_layers"


def build() -> Path:
    from torch.utils.cpp_extension import load

    BUILD_DIR.mkdir(exist_ok=True)
    sources = [str(source) for source in SOURCES]
    # -fopenmp: at::parallel_for is a header template that runs serially in code compiled without
    # it (the kernels ran on one thread whatever torch's thread count). The library it links,
    # libgomp.so.1, resolves to the copy torch has already loaded, so one OpenMP runtime runs.
    try:
        load(NAME, sources, build_directory=str(BUILD_DIR), extra_cflags=["-O2", "-fopenmp"],
             extra_ldflags=["-fopenmp"], verbose=False)
    except (RuntimeError, OSError) as exc:  # a compiler without OpenMP: decode steps still use
        # step_pool.cpp's own threads; loops outside a step (prefill) run on one thread
        log.warning("native_without_openmp", error=str(exc).splitlines()[-1] if str(exc) else repr(exc))
        load(NAME, sources, build_directory=str(BUILD_DIR), extra_cflags=["-O2"], verbose=False)
    return built_library()


def built_library() -> Path | None:
    found = sorted(BUILD_DIR.glob(f"{NAME}*.so"))
    return found[0] if found else None


@functools.cache
def extension():
    """The compiled module, or None (not built, stale, built for another torch, or turned off)."""
    if os.environ.get("DFLASH_NATIVE", "1") == "0":
        return None
    library = built_library()
    if library is None:
        return None
    if library.stat().st_mtime < max(source.stat().st_mtime for source in SOURCES + HEADERS):
        log.warning("native_stale", library=str(library), fix="run `make install` to rebuild; using Python")
        return None
    try:
        spec = importlib.util.spec_from_file_location(NAME, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as exc:  # e.g. built against another torch
        log.warning("native_unusable", library=str(library), error=str(exc))
        return None
    return module


# decode_layers' kinds of linear (decode_layers.cpp, LinearKind): torch's quantized kernels, or ours.
DENSE, TORCH_INT8, TORCH_INT4, INT8_DOT, INT4_DOT = 0, 1, 2, 3, 4


def layer_arguments(model) -> dict:
    """The per-layer tensors of a model.Transformer, flattened the way decode_layers takes them."""
    from dflash.engine.quant import INT4_GROUP, Int4Linear, Int8Linear

    empty = torch.empty(0)
    norms, qk_norms, tensors, kinds, has_bias, out_features = [], [], [], [], [], []
    for layer in model.layers:
        attention, ffn = layer.attention, layer.feed_forward
        norms += [layer.attention_norm.weight, layer.ffn_norm.weight]
        if attention.q_norm is not None:
            qk_norms += [attention.q_norm.weight, attention.k_norm.weight]
        for linear in (attention.wqkv, attention.wo, ffn.w13, ffn.w2):
            if isinstance(linear, Int4Linear):
                kinds.append(TORCH_INT4 if linear.kernels == "torch" else INT4_DOT)
                tensors += [linear.packed, linear.scales_and_zeros]
            elif isinstance(linear, Int8Linear):
                kinds.append(TORCH_INT8 if linear.kernels == "torch" else INT8_DOT)
                tensors += [linear.qweight, linear.scales]
            else:
                kinds.append(DENSE)
                tensors += [linear.weight, empty]
            tensors.append(linear.bias if linear.bias is not None else empty)
            has_bias.append(int(linear.bias is not None))
            out_features.append(linear.out_features)
    return dict(norms=norms, qk_norms=qk_norms, linear_tensors=tensors, kinds=kinds, has_bias=has_bias,
                out_features=out_features, group_size=INT4_GROUP)
