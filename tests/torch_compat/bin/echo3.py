#!/usr/bin/env python3
"""Dies of SIGSEGV with ``--segfault true`` (torch's echo3)."""

import argparse
import ctypes
import os

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--segfault", type=bool, default=False)
    parser.add_argument("msg", type=str)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    if args.segfault:
        ctypes.string_at(0)
    print(f"{args.msg} from {rank}")
