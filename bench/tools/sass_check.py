"""Which matrix instructions do the engine's kernels run?  The machine code of one compiled step, counted.

Usage (from the repository root)::

    python bench/tools/sass_check.py                        # H100 / H200: ~1 minute (needs cuobjdump)
    python bench/tools/sass_check.py --smoke --out /tmp/sc  # tiny shapes on the CPU: no GPU code, the parse only

The mixed steps' shared part runs at ~240-275 TFLOP/s (bench/NOTES.md, runs AE, AW and AX), about 40% of the
matmul ceiling measured beside it, and no knob moved it.  On Hopper a matrix kernel is on the fast path
only when its machine code holds warpgroup MMAs (``HGMMA``); ``HMMA`` alone is the older per-warp
``mma.sync`` path, which peaks well under it.  This compiles one layer's attention of the served loop's
512-token mixed step (``bench/kernels/mixed_shared.py``'s ``spread``: the ragged kernel and the shared part,
the engine's defaults), the skinny-matmul kernel at 64 rows (``pallas_kernels/gemm.py``) and one XLA dot,
serializes each executable (``jax.experimental.serialize_executable``), cuts the CUDA ELF images out of it
(inside snappy blocks, each ELF's size from its header; a large executable's container is not read yet: run BA
found no image in the attention step's, bench/NOTES.md), disassembles them with ``cuobjdump --dump-sass`` and counts, per
kernel function, the matrix (``HGMMA`` / ``HMMA``), async-copy (``LDGSTS``, bulk ``UTMALDG``) and
shared-memory instructions.  Writes ``sass_check.md`` to ``--out`` (and each kernel's SASS beside it).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from collections import Counter

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
# (the engine's packages, bench/lib and bench/kernels go on sys.path in main(): importing this file for its
# parsers, as its tests do, leaves the importer's path alone; bench/kernels/kernels.py would shadow the
# `kernels` package transformers looks for)

# the instruction families counted (SASS opcode prefixes: an opcode's first dotted part)
COUNTED = ("HGMMA", "HMMA", "WARPGROUP", "LDGSTS", "UTMALDG", "LDSM", "LDS", "STS", "LDG", "STG", "FFMA", "MUFU")


EM_CUDA = 190  # an ELF header's e_machine for NVIDIA GPU code


def elf_images(blob: bytes, machine: int | None = EM_CUDA) -> list[bytes]:
    """The 64-bit little-endian ELF images inside ``blob`` for ``machine`` (None: any), each cut at the
    end its header gives (the later of the section-header table's and the program-header table's ends)."""
    images, at = [], 0
    while (at := blob.find(b"\x7fELF\x02\x01", at)) >= 0:
        head = blob[at:at + 64]
        if len(head) < 64:
            break
        phoff, shoff = struct.unpack_from("<QQ", head, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 0x36)
        end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
        if 64 <= end <= len(blob) - at:
            if machine is None or struct.unpack_from("<H", head, 0x12)[0] == machine:
                images.append(blob[at:at + end])
            at += end
        else:
            at += 4
    return images


def snappy_block(buf: bytes, at: int) -> tuple[bytes, int]:
    """One raw snappy block (a varint of its decoded size, then literal and copy elements) decoded from
    ``buf[at:]``: (its bytes, the index after it); ValueError where ``buf[at:]`` is not one."""
    def varint(i):
        value = shift = 0
        while True:
            if i >= len(buf) or shift > 28:
                raise ValueError("bad varint")
            c = buf[i]
            value, shift, i = value | (c & 0x7F) << shift, shift + 7, i + 1
            if c < 0x80:
                return value, i

    size, i = varint(at)
    if size > 1 << 26:
        raise ValueError("too large")
    out = bytearray()
    while len(out) < size:
        if i >= len(buf):
            raise ValueError("past the end")
        tag, kind, i = buf[i], buf[i] & 3, i + 1
        if kind == 0:  # a literal: its length - 1 in the tag, or in the 1-4 bytes after it
            n = tag >> 2
            if n >= 60:
                n, i = int.from_bytes(buf[i:i + n - 59], "little"), i + n - 59
            out += buf[i:i + n + 1]
            i += n + 1
            continue
        if kind == 1:
            n, off, i = ((tag >> 2) & 7) + 4, (tag >> 5) << 8 | buf[i], i + 1
        else:
            width = 2 if kind == 2 else 4
            n, off, i = (tag >> 2) + 1, int.from_bytes(buf[i:i + width], "little"), i + width
        if not 0 < off <= len(out):
            raise ValueError("bad copy")
        for _ in range(n):
            out.append(out[-off])
    if len(out) != size:
        raise ValueError("size")
    return bytes(out), i


def gpu_images(blob: bytes, depth: int = 2) -> list[bytes]:
    """The GPU ELF images in a serialized executable: plain, or inside snappy blocks (XLA's GPU executables keep
    their code snappy-compressed, a module's ELF compressed again inside; found by trying each offset)."""
    found = elf_images(blob)
    if found or depth == 0:
        return found
    at = 0
    while at < len(blob):
        try:
            inner, end = snappy_block(blob, at)
        except (ValueError, IndexError):
            at += 1
            continue
        sub = gpu_images(inner, depth - 1) if len(inner) > 64 and b"\x7fELF" in inner else []
        found += sub
        at = end if sub else at + 1
    return found


def count_sass(sass: str) -> dict[str, Counter]:
    """Per function of a ``cuobjdump --dump-sass`` listing: how many of each ``COUNTED`` family."""
    out: dict[str, Counter] = {}
    fn = None
    for line in sass.splitlines():
        m = re.match(r"\s*Function\s*:\s*(\S+)", line)
        if m:
            fn = m.group(1)
            out.setdefault(fn, Counter())
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m and fn is not None:
            op = m.group(1)
            for fam in COUNTED:
                if op == fam or op.startswith(fam + "."):
                    out[fn][fam] += 1
                    break
    return out


def serialized(fn, *args) -> bytes:
    """The serialized executable of ``jax.jit(fn)`` at ``args``."""
    from jax.experimental.serialize_executable import serialize

    compiled = jax.jit(fn).lower(*args).compile()
    payload, _, _ = serialize(compiled)
    return payload


def cases(smoke: bool):
    """(name, fn, args) of each executable: the spread step's attention, the skinny matmul, an XLA dot."""
    import mixed_shared
    from inferscale_jax import kv_cache
    from pallas_kernels.gemm import default_blocks, matmul_pallas

    cfg = mixed_shared.SMOKE if smoke else mixed_shared.FULL
    decode, questions, tokens = cfg["steps"]["spread"]
    kp, vp, sets, *_ = mixed_shared.step_case(cfg, decode, questions, tokens)
    q, casc, _flat = sets[0]

    def attend(k, v, q, meta):
        return kv_cache._attend(q[None], k, v, None, meta, "pallas")[0]

    m, k_dim, n = (8, 64, 128) if smoke else (64, 4096, 6144)
    x = jax.random.normal(jax.random.PRNGKey(1), (m, k_dim), jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(2), (k_dim, n), jnp.bfloat16)
    blocks = default_blocks(m, k_dim, n)
    yield "attention, spread step (ragged + shared part)", attend, (kp, vp, q, casc)
    yield f"skinny matmul {m}x{k_dim}x{n}", lambda a, b: matmul_pallas(a, b, **blocks, interpret=smoke), (x, w)
    yield f"XLA dot {m * 8}x{k_dim}x{n}", lambda a, b: a @ b, (jnp.tile(x, (8, 1)), w)


def _file_stem(name: str) -> str:
    """A case's name as a file name's start."""
    return re.sub(r"[^A-Za-z0-9]+", "_", name)[:40]


def main():
    sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib"), os.path.join(ROOT, "bench", "kernels")]
    from report import finish, log, table

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "sass_check"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (no GPU code to count)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    tool = shutil.which("cuobjdump") or next(
        (p for p in ("/usr/local/cuda/bin/cuobjdump",) if os.path.exists(p)), None)
    rows, notes = [], [f"cuobjdump: {tool or 'not found'}"]
    for name, fn, fargs in cases(args.smoke):
        blob = serialized(fn, *fargs)
        images = gpu_images(blob)
        log(f"{name}: executable {len(blob) / 2**20:.1f} MiB, {len(images)} GPU ELF image(s) "
            f"({len(elf_images(blob, None))} ELF images of any machine)")
        if not images or tool is None:  # (kept for a look: where the code is, if not as ELF)
            with open(os.path.join(args.out, f"{_file_stem(name)}.bin"), "wb") as f:
                f.write(blob)
            rows.append([name, "(none)", len(blob), *[""] * len(COUNTED)])
            continue
        for i, image in enumerate(images):
            path = os.path.join(args.out, f"{_file_stem(name)}_{i}.cubin")
            with open(path, "wb") as f:
                f.write(image)
            res = subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True, timeout=120)
            if res.returncode != 0:
                notes.append(f"{name} image {i}: cuobjdump failed: {res.stderr.strip()[:200]}")
                continue
            with open(path[:-6] + ".sass", "w") as f:
                f.write(res.stdout)
            os.remove(path)
            for func, counts in sorted(count_sass(res.stdout).items()):
                rows.append([name, func[:60], len(image), *[counts.get(c, 0) for c in COUNTED]])
    table("Instructions per kernel function (static counts in the machine code)",
          ["executable", "function", "ELF bytes", *COUNTED], rows)
    finish(args.out, "sass_check.md", "Matrix instructions of the engine's kernels", t0, ROOT, notes)


if __name__ == "__main__":
    main()
