"""bench/tools/sass_check.py's parsers: GPU ELF images cut out of a serialized executable by their headers (other
machines' images skipped), found inside nested snappy blocks, and a ``cuobjdump --dump-sass`` listing counted per
function."""

import importlib.util
import os
import struct

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# (loaded from its file: neither bench/tools nor what the tool puts on sys.path when run joins this process's path)
_spec = importlib.util.spec_from_file_location("sass_check", os.path.join(ROOT, "bench", "tools", "sass_check.py"))
sass_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_check)


def _elf(machine: int, body: bytes) -> bytes:
    """A minimal 64-bit ELF: header, ``body``, then a section-header table of two 64-byte entries."""
    shoff = 64 + len(body)
    head = bytearray(64)
    head[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<H", head, 0x12, machine)
    struct.pack_into("<QQ", head, 0x20, 0, shoff)  # no program headers
    struct.pack_into("<HHHH", head, 0x36, 56, 0, 64, 2)
    return bytes(head) + body + bytes(128)


def test_elf_images_are_cut_at_their_header_ends():
    cuda_a, host, cuda_b = _elf(190, b"A" * 40), _elf(62, b"x" * 17), _elf(190, b"B" * 3)
    blob = b"junk" + cuda_a + b"\x00" * 9 + host + cuda_b + b"tail"
    assert sass_check.elf_images(blob) == [cuda_a, cuda_b]
    assert sass_check.elf_images(blob, None) == [cuda_a, host, cuda_b]
    assert sass_check.elf_images(cuda_a[:-1]) == []  # (cut short: its table runs past the end)


SASS = """
	code for sm_90a
		Function : shared_kernel
	.headerflags	@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   LDGSTS.E.BYPASS.LTC128B.128 [R3], desc[UR6][R4.64] ;
        /*0020*/                   WARPGROUP.ARRIVE ;
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24, gsb0 ;
        /*0040*/              @!P0 HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0050*/                   MUFU.EX2 R7, R7 ;
		Function : ragged_kernel
        /*0000*/                   HMMA.16816.F32.BF16 R8, R12, R16, R8 ;
        /*0010*/              @P1 LDSM.16.MT88.4 R4, [R2] ;
        /*0020*/                   LDS.128 R4, [R2+0x10] ;
        /*0030*/                   FFMA R1, R2, R3, R1 ;
"""


def test_count_sass_counts_each_family_per_function():
    counts = sass_check.count_sass(SASS)
    assert set(counts) == {"shared_kernel", "ragged_kernel"}
    shared, ragged = counts["shared_kernel"], counts["ragged_kernel"]
    assert (shared["HGMMA"], shared["WARPGROUP"], shared["LDGSTS"], shared["MUFU"], shared["HMMA"]) == (2, 1, 1, 1, 0)
    assert (ragged["HMMA"], ragged["LDSM"], ragged["LDS"], ragged["FFMA"], ragged["HGMMA"]) == (1, 1, 1, 1, 0)


def _snappy(data: bytes, repeat: int) -> bytes:
    """``data`` then its last ``repeat`` bytes again, as one raw snappy block: a varint size, literals of at most 60
    bytes, then one two-byte-offset copy."""
    size, head = len(data) + repeat, bytearray()
    while True:
        head.append((size & 0x7F) | (0x80 if size >= 0x80 else 0))
        size >>= 7
        if not size:
            break
    for at in range(0, len(data), 60):
        part = data[at:at + 60]
        head += bytes([(len(part) - 1) << 2]) + part
    return bytes(head) + bytes([(repeat - 1) << 2 | 2]) + struct.pack("<H", repeat)


def test_gpu_images_are_found_inside_nested_snappy_blocks():
    cuda = _elf(190, b"C" * 100)
    inner = _snappy(b"head" + cuda, 16)  # (the ELF, then 16 bytes copied from its end)
    assert sass_check.snappy_block(inner, 0) == (b"head" + cuda + cuda[-16:], len(inner))
    blob = b"proto" + _snappy(b"x" * 7 + inner + b"y" * 5, 4) + b"rest"
    assert sass_check.elf_images(blob) == []  # (compressed: no whole image in the plain bytes)
    assert sass_check.gpu_images(blob) == [cuda]
