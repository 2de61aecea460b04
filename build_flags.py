"""The compiler flags of the native extension (pocketlm/runtime/csrc), in one place.

setup.py builds pocketlm._native with them, and tests/test_arm_build.py compiles the same
sources with them for the host and for ARM64: the bit-identity of results across builds holds
for sources compiled alike. Plain data, importable without running setup().
"""

from __future__ import annotations

# GCC / Clang. -std=c11: ISO C (no GNU extensions needed; GCC then also contracts no
# a * b + c into a fused multiply-add, which -ffp-contract=off spells out whatever the
# compiler's default: the vector code writes its fused multiply-adds as intrinsics, and the
# portable and NEON code must round every product and sum as written).
CFLAGS = ["-O3", "-std=c11", "-fno-strict-aliasing", "-Wall", "-Wno-unknown-pragmas", "-pthread",
          "-ffp-contract=off"]
LDFLAGS = ["-pthread"]

# MSVC
MSVC_CFLAGS = ["/O2"]
