"""Make PyPI's torchvision importable beside the CPU build of torch.

The index's torchvision is built against CUDA torch. Its ``_meta_registrations.py`` registers fake kernels for
``torchvision::nms`` and ``torchvision::qnms`` unconditionally, and that fails when its compiled ops did not load
(they never do beside CPU torch), so ``import torchvision`` raises. Guarding the two decorators with
``torchvision.extension._has_ops()`` leaves its pure-Python transforms (which Qwen2.5-VL's processor needs) usable.

Idempotent: a second run finds the guard in place and changes nothing.
"""

import importlib.util
import pathlib
import sys

OPS = ("nms", "qnms")


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None:
        print("torchvision is not installed; nothing to guard")
        return 0
    path = pathlib.Path(spec.submodule_search_locations[0]) / "_meta_registrations.py"
    text = original = path.read_text()
    for op in OPS:
        plain = f'@torch.library.register_fake("torchvision::{op}")\n'
        guarded = (
            f'@(torch.library.register_fake("torchvision::{op}") '
            f"if torchvision.extension._has_ops() else (lambda fn: fn))\n"
        )
        text = text.replace(plain, guarded)
    if text != original:
        path.write_text(text)
        print(f"guarded {', '.join(OPS)} in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
