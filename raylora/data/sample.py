"""One training example in the form every data format is read into (`raylora.data.formats`) and every batch
is built from (`raylora.data`).

`messages` follow Hugging Face's chat style after normalisation: a list of turns
`{"role": "system" | "user" | "assistant", "content": [part, ...]}`, each part
`{"type": "text", "text": str}`, `{"type": "image"}` or `{"type": "video"}`. `images` holds one entry per
image part, in the order the parts appear: encoded bytes (PNG, JPEG, ...) or a path/URI already resolved
against `data.image_root`. `videos` likewise holds one entry per video part: a path/URI, encoded bytes, or a
list of frames (paths or bytes).
Nothing here is decoded: a row is decoded only when a batch uses it, so a bad image is met (and skipped) at
that point.

A sample's videos are decoded when a batch uses it (`raylora.data.formats.load_video`), never here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sample:
    messages: list[dict]
    images: list[bytes | str] = field(default_factory=list)
    videos: list[bytes | str | list[bytes | str]] = field(default_factory=list)

    @property
    def image_count(self) -> int:
        return self._parts("image")

    @property
    def video_count(self) -> int:
        return self._parts("video")

    def _parts(self, kind: str) -> int:
        return sum(1 for turn in self.messages for part in turn["content"] if part["type"] == kind)
