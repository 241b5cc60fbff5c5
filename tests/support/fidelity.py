"""How close two renderings of one image are: mean SSIM of their luma planes.

One measure for the tests (shrink-on-load against a full decode) and the benchmarks
(bench/avif.py's calibration, bench/sharp.py against sharp's output): Wang et al. 2004,
Gaussian window sigma 1.5, K1 0.01, K2 0.03, on Y' of BT.601, alpha flattened onto white.
Computed with libvips, so it costs milliseconds on a 1600 px image.
"""

from __future__ import annotations

from typing import Any


def _luma(data: bytes) -> Any:
    import pyvips

    image = pyvips.Image.new_from_buffer(data, "")
    if image.hasalpha():
        image = image.flatten(background=[255, 255, 255])
    if image.bands == 1:
        return image.cast("float")
    return image.recomb([[0.299, 0.587, 0.114]]).cast("float")


def ssim(reference: bytes, test: bytes) -> float:
    """Mean SSIM of the luma planes of two encoded images of the same size (1.0: same)."""
    x, y = _luma(reference), _luma(test)
    if (x.width, x.height) != (y.width, y.height):
        raise ValueError(f"sizes differ: {x.width}x{x.height} vs {y.width}x{y.height}")
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2

    def blur(image: Any) -> Any:
        return image.gaussblur(1.5, precision="float")

    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x * mu_x
    var_y = blur(y * y) - mu_y * mu_y
    cov = blur(x * y) - mu_x * mu_y
    num = (mu_x * mu_y * 2 + c1) * (cov * 2 + c2)
    den = (mu_x * mu_x + mu_y * mu_y + c1) * (var_x + var_y + c2)
    return float((num / den).avg())
