"""One training example in the form every data format is read into (`raylora.formats`) and every batch
is built from (`raylora.data`).

`messages` follow Hugging Face's chat style after normalisation: a list of turns
`{"role": "system" | "user" | "assistant", "content": [part, ...]}`, each part `{"type": "text", "text": str}`
or `{"type": "image"}`. `images` holds one entry per image part, in the order the parts appear: encoded
bytes (PNG, JPEG, ...) or a path/URI already resolved against `data.image_root`. Nothing here is decoded:
a row is decoded only when a batch uses it, so a bad image is met (and skipped) at that point.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sample:
    messages: list[dict]
    images: list[bytes | str] = field(default_factory=list)

    @property
    def image_count(self) -> int:
        return sum(1 for turn in self.messages for part in turn["content"] if part["type"] == "image")
