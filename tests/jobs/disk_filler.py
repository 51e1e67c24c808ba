"""A job for the full-disk test: its first attempt fills the filesystem under the run directory and crashes
while it is full; the next attempt frees the space and finishes.

A marker outside the full filesystem remembers which attempt this is.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--filler", required=True, help="a file on the filesystem to fill")
    p.add_argument("--marker", required=True, help="a file elsewhere: exists after the first attempt")
    args = p.parse_args()
    filler, marker = Path(args.filler), Path(args.marker)
    if marker.exists():
        filler.unlink(missing_ok=True)
        print("second attempt: freed the disk", flush=True)
        return 0
    marker.write_text("first attempt ran")
    chunk = b"\0" * 65536
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
    print(f"filled the disk: {os.path.getsize(filler)} bytes", flush=True)
    for i in range(300):  # output the supervisor must keep draining while it cannot write its log
        print(f"line {i} " + "x" * 200, flush=True)
    time.sleep(1.0)
    print("crashing on purpose with the disk full", flush=True)
    return 3


if __name__ == "__main__":
    sys.exit(main())
