"""A model folder that brings its own code (`trust_remote_code`), built from a tiny Llava."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

REMOTE_MODELING = '''"""A vision-language model that brings its own code, as Phi-3-vision's Hub folder
does (auto_map in config.json): loaded only through transformers' remote-code path. Its model type is
one that neither transformers nor raylora knows; the classes are Llava's under other names."""

from transformers import LlavaConfig, LlavaForConditionalGeneration

class RemoteVlmConfig(LlavaConfig):
    model_type = "raylora_remote_vlm"

class RemoteVlmForConditionalGeneration(LlavaForConditionalGeneration):
    config_class = RemoteVlmConfig
'''

# What a run on REMOTE_MODELING names, since raylora's registry has no entry for its model type.
REMOTE_PARTS = (
    "model.trust_remote_code=true",
    "model.language_model=model.language_model",
    "model.vision_tower=model.vision_tower",
    "model.aligner=model.multi_modal_projector",
)


def make_remote_code_model(llava_dir: str | Path, out: Path, legacy_names: bool = False) -> Path:
    """A copy of a tiny Llava folder (same weights) that carries its own modeling file, as a Hub folder
    with remote code does: `modeling_remote_vlm.py` and config.json's `auto_map` naming its classes.

    Its weights are saved under the names of its modules, as a remote-code model's files are. With
    `legacy_names` they keep the names transformers writes for Llava (`language_model.lm_head.weight`),
    which only Llava's own model type maps back: the remote class then lacks its lm_head.

    A folder whose code behaves like Phi-3-vision's (written for transformers 4) is
    `tests.phi3v_fixture.make_phi3v_model`."""
    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText

    shutil.copytree(llava_dir, out)
    if not legacy_names:
        state = AutoModelForImageTextToText.from_pretrained(llava_dir).state_dict()
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    (out / "modeling_remote_vlm.py").write_text(REMOTE_MODELING)
    config = json.loads((out / "config.json").read_text())
    config.update(
        model_type="raylora_remote_vlm",
        architectures=["RemoteVlmForConditionalGeneration"],
        auto_map={
            "AutoConfig": "modeling_remote_vlm.RemoteVlmConfig",
            "AutoModelForImageTextToText": "modeling_remote_vlm.RemoteVlmForConditionalGeneration",
        },
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
