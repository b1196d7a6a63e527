"""/fork's copy of a KV file: milliseconds per 100 MiB with copy_file_range and with reads and writes.

    .venv/bin/python benchmarks/fork_copy.py DIR [DIR ...] [--mib 400]

In each DIR (a directory on the file system to measure: ext4, tmpfs, an XFS or btrfs mount, whose
copy_file_range shares blocks), a file of --mib MiB of random bytes is copied as Session.fork copies
a parent's records (persist.kvfile.copy_bytes), five times each way, then fsynced as a save is; the
best time is reported, per 100 MiB, with the space the file system gives the copy (statvfs before and
after one more copy: a shared copy takes next to none; `du` counts shared blocks once per file).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from colichat.persist.kvfile import copy_bytes  # noqa: E402


def fs_type(directory: str) -> str:
    out = subprocess.run(["df", "--output=fstype", directory], capture_output=True, text=True).stdout.split()
    return out[-1] if out else "?"


def used(directory: str) -> int:
    st = os.statvfs(directory)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def copy_once(src: str, dst: str, size: int, plain: bool) -> float:
    saved = getattr(os, "copy_file_range", None)
    if plain and saved is not None:
        del os.copy_file_range
    try:
        fs, fd = os.open(src, os.O_RDONLY), os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        t0 = time.perf_counter()
        copy_bytes(fs, fd, size)
        os.fsync(fd)
        took = time.perf_counter() - t0
        os.close(fs), os.close(fd)
    finally:
        if plain and saved is not None:
            os.copy_file_range = saved
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--mib", type=int, default=400)
    args = ap.parse_args()
    size = args.mib << 20
    print("| file system | copy_file_range | reads and writes | space the copy takes |")
    print("|---|---|---|---|")
    for d in args.dirs:
        src, dst = os.path.join(d, "bench-src.coli_kv"), os.path.join(d, "bench-dst.coli_kv")
        with open(src, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(1 << 20))
            f.flush()
            os.fsync(f.fileno())
        per100 = {}
        for plain in (False, True):
            per100[plain] = min(copy_once(src, dst, size, plain) for _ in range(5)) * 1000 * 100 / args.mib
        os.unlink(dst)
        before = used(d)
        copy_once(src, dst, size, False)
        taken = (used(d) - before) >> 20
        print(f"| {fs_type(d)} ({d}) | {per100[False]:.1f} ms | {per100[True]:.1f} ms | {taken} MiB for a copy of "
              f"{args.mib} MiB |", flush=True)
        os.unlink(src), os.unlink(dst)


if __name__ == "__main__":
    main()
