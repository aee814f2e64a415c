"""`digit-reader IMAGES.npy`: print the digit read in each image, with its probability."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from .process import read_digits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="digit-reader", description=__doc__)
    parser.add_argument("images", help=".npy file of 0..16 pixel values, [N, 8, 8] or [N, 64]")
    args = parser.parse_args(argv)
    try:
        labels, confidence = read_digits(np.load(args.images))
    except (OSError, ValueError) as error:
        print(f"digit-reader: {args.images}: {error}", file=sys.stderr)
        return 1
    for index, (label, p) in enumerate(zip(labels, confidence)):
        print(f"{index}: {label} ({p:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
