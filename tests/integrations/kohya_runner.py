"""Run one of kohya sd-scripts' training scripts, unmodified, on a tiny SD 1.5 model.

``python kohya_runner.py SCRIPT.py ARGS...`` (or under ``accelerate launch``): kohya rebuilds SD
1.5's UNet as ``library.original_unet.UNet2DConditionModel``, whose widths are module constants
(``BLOCK_OUT_CHANNELS``, ``TIMESTEP_INPUT_DIM``, ``TIME_EMBED_DIM``). This sets them from the
``unet/config.json`` of ``--pretrained_model_name_or_path`` and then runs SCRIPT as ``__main__``
with ``sys.argv`` as if it had been launched itself.
"""

from __future__ import annotations

import json
import os
import runpy
import sys


def main() -> None:
    script, args = os.path.abspath(sys.argv[1]), sys.argv[2:]
    sys.path.insert(0, os.path.dirname(script))
    model = args[args.index("--pretrained_model_name_or_path") + 1]
    with open(os.path.join(model, "unet", "config.json")) as f:
        widths = tuple(json.load(f)["block_out_channels"])
    from library import original_unet

    original_unet.BLOCK_OUT_CHANNELS = widths
    original_unet.TIMESTEP_INPUT_DIM = widths[0]
    original_unet.TIME_EMBED_DIM = widths[0] * 4
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
