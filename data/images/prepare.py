"""Images with their classes, for a vision transformer (config/train_vit_digits_cpu.py).

  python data/images/prepare.py digits                 # scikit-learn's 8x8 digits, offline: data/digits
  python data/images/prepare.py path/to/folder --size=32 --out=data/mine   # one subfolder per class
  python data/images/prepare.py cifar10                # CIFAR-10 from the Hugging Face Hub (online)

digits: 1,797 images, pixels / 16, the last 360 held out (val), never trained on. A folder: every image
resized to --size pixels a side (RGB), pixels / 255, a seeded --val_fraction of each class held out.
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
from configurator import DataError, cli_main  # noqa: E402
from labeled import cifar10, digits, image_folder, write_images  # noqa: E402


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="digits | cifar10 | a folder with one subfolder per class")
    parser.add_argument("--out", help="output folder (default: data/<source name>)")
    parser.add_argument("--size", type=int, default=32, help="a folder's images are resized to this many pixels a side")
    parser.add_argument("--val_fraction", type=float, default=0.1, help="a folder's held-out share of each class")
    args = parser.parse_args(argv)
    if args.source == "digits":
        splits, classes, rescale = digits()
    elif args.source == "cifar10":
        splits, classes, rescale = cifar10()
    elif os.path.isdir(args.source):
        if args.size < 1 or not 0 < args.val_fraction < 1:
            raise DataError(f"--size={args.size} must be >= 1 and --val_fraction={args.val_fraction} in (0, 1)")
        splits, classes, rescale = image_folder(args.source, args.size, args.val_fraction)
    else:
        raise DataError(f"{args.source!r} is neither digits, cifar10 nor a folder")
    name = os.path.basename(os.path.normpath(args.source))
    out = args.out or os.path.normpath(os.path.join(HERE, "..", name))
    meta = write_images(out, splits, classes, rescale, args.source)
    print(f"{out}: {len(splits['train'][1]):,} train and {len(splits['val'][1]):,} val images, {meta['channels']} x "
          f"{meta['image_size']} x {meta['image_size']}, {len(classes)} classes")


if __name__ == "__main__":
    cli_main(main)
