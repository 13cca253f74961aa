"""The operator's media policy for image inputs (flags --allowed-media-path, --allow-media-urls,
--max-image-bytes, --max-image-pixels, --max-images-per-request): what a request may name and how big it may be.
Imports nothing heavy (the config module reads it)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MediaPolicy:
    allowed_media_path: Path | None = None  # local files inside this directory may be read; None = none
    allow_media_urls: bool = False  # http(s) URLs are fetched (from the scheduler's host)
    max_image_bytes: int = 20 * 1024 * 1024  # an encoded image file
    max_image_pixels: int = 40_000_000  # width x height of a decoded image
    max_images: int = 8  # images per request
    fetch_timeout_s: float = 10.0  # one URL fetch, connect and read

    def validate(self) -> None:
        if self.max_image_bytes < 1 or self.max_image_pixels < 1 or self.max_images < 1:
            raise ValueError("--max-image-bytes, --max-image-pixels and --max-images-per-request must be >= 1")
        if self.allowed_media_path is not None and not self.allowed_media_path.is_dir():
            raise ValueError("--allowed-media-path must name an existing directory")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = MediaPolicy()
    g = ap.add_argument_group("image inputs (vision-language models: docs/models.md#vision-language-models)")
    g.add_argument("--allowed-media-path", type=Path, default=None, metavar="DIR",
                   help="let requests name local image files (a file:// URL, or GenerateService's path) inside DIR; "
                        "default: no local files are read")
    g.add_argument("--allow-media-urls", action="store_true",
                   help="fetch http(s) image URLs from the scheduler's host (each bounded by --max-image-bytes and a "
                        f"{d.fetch_timeout_s:.0f} s timeout; mind that the server then reaches whatever URL a client "
                        "names). Default: only data: URLs (and files under --allowed-media-path)")
    g.add_argument("--max-image-bytes", type=int, default=d.max_image_bytes, metavar="N",
                   help=f"largest encoded image file a request may carry or name (default {d.max_image_bytes})")
    g.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels, metavar="N",
                   help="most pixels (width x height, read from the file's header before decoding) of one image "
                        f"(default {d.max_image_pixels})")
    g.add_argument("--max-images-per-request", type=int, default=d.max_images, metavar="N",
                   help=f"most images one request may carry (default {d.max_images})")


def from_args(args: argparse.Namespace) -> MediaPolicy:
    return MediaPolicy(args.allowed_media_path, args.allow_media_urls, args.max_image_bytes, args.max_image_pixels,
                       args.max_images_per_request)
