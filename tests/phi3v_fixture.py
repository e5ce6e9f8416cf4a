# ruff: noqa: E501 (the embedded modules keep the long lines of the code they stand in for)
"""A tiny remote-code folder that behaves like Microsoft's Phi-3-vision / Phi-3.5-vision Hub folders, written
for raylora's tests (nothing in it is Microsoft's; the project holds only what it wrote).

It stands in for the real folder where raylora meets it, so its own modeling, configuration, image-embedding,
image-processing and processing files are built as the real ones are and use what transformers 5 removed
the same way (checked against public copies of the Hub files: see `tests/test_phi3_vision.py`):

- config.json: `model_type` phi3_v, `auto_map` for AutoConfig and AutoModelForCausalLM, `embd_layer` (HD
  transform, MLP projection, learnable separators) and `img_processor` dicts, and `_attn_implementation:
  flash_attention_2`; preprocessor_config.json: `auto_map` for AutoProcessor and AutoImageProcessor.
- the model: `Phi3VForCausalLM` > `Phi3VModel` with `embed_tokens`, `vision_embed_tokens` (a
  `Phi3ImageEmbedding`: a CLIP vision model as `img_processor`, `glb_GN` / `sub_GN`, and an MLP
  `img_projection`), decoder `layers` (fused `qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`), `norm`,
  `lm_head`: the real parameter names. Its attention forwards call `past_key_value.get_usable_length`,
  `Phi3VModel.forward` `DynamicCache.from_legacy_cache` / `get_usable_length` / `to_legacy_cache`, and
  `prepare_inputs_for_generation` `seen_tokens` and `get_max_length()`; `_tied_weights_keys` is a list,
  `_supports_flash_attn_2 = True`, `_supports_sdpa = False`. Image tokens are negative ids (-N for image
  N) that the embedding clamps in place, and it runs the vision tower only when a batch has some.
- the processor: `Phi3VProcessor.__init__` sets its two parts without `ProcessorMixin.__init__` (so no
  `chat_template` attribute); it splits one text at `<|image_N|>` tags, tokenises each piece alone (a BOS
  in front of each) and puts each image's tokens in its tag's place. The image processor imports
  torchvision and pads, resizes and normalises with it (HD transform: crops of `crop_size` plus a global
  view). Where the real files fix the CLIP ViT-L/14-336 tower and 336-pixel crops, these take the tower's
  config and the crop size from the folder's config, so that the model is tiny.
- the tokenizer: a SentencePiece-style Llama tokenizer (`tests.real_tokenizers.sentencepiece_llama`) with
  Phi-3's special tokens; the chat template renders `<|role|>\\n` + content + `<|end|>\\n`, content as a
  string, and the generation prompt `<|assistant|>\\n`.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIGURATION = '''"""Phi-3-vision-like configuration (raylora test fixture)."""

from transformers import PretrainedConfig


class Phi3VConfig(PretrainedConfig):
    model_type = "phi3_v"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size=32064,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=None,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attention_dropout=0.0,
        hidden_act="silu",
        max_position_embeddings=4096,
        original_max_position_embeddings=4096,
        initializer_range=0.02,
        rms_norm_eps=1e-5,
        use_cache=True,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        rope_scaling=None,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        sliding_window=None,
        embd_layer="default",
        img_processor=None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.resid_pdrop = resid_pdrop
        self.embd_pdrop = embd_pdrop
        self.attention_dropout = attention_dropout
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.original_max_position_embeddings = original_max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.sliding_window = sliding_window
        self.embd_layer = embd_layer
        self.img_processor = img_processor
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
'''

IMAGE_EMBEDDING = '''"""Phi-3-vision-like image embedding (raylora test fixture): a CLIP vision model, 2x2-merged patch
features of each crop and of the global view, learnable separators, an MLP projection."""

import torch
from torch import nn
from transformers import CLIPVisionConfig, CLIPVisionModel

MAX_INPUT_ID = int(1e9)


class Phi3ImageEmbedding(nn.Module):
    def __init__(self, config, wte=None, **kwargs):
        super().__init__()
        hidden_size = config.hidden_size
        self.drop = nn.Dropout(config.embd_pdrop)
        self.wte = wte
        spec = config.img_processor
        assert isinstance(spec, dict) and spec.get("name") == "clip_vision_model", spec
        clip_config = CLIPVisionConfig(**spec["clip_config"])
        self.img_processor = CLIPVisionModel(clip_config)
        self.image_dim_out = spec["image_dim_out"]
        self.crop_size = clip_config.image_size
        self.grid = clip_config.image_size // clip_config.patch_size
        self.layer_idx = spec.get("layer_idx", -2)
        self.use_hd_transform = kwargs.get("use_hd_transform", False)
        self.with_learnable_separator = kwargs.get("with_learnable_separator", False)
        self.hd_transform_order = kwargs.get("hd_transform_order", "glb_sub")
        if self.with_learnable_separator:
            self.glb_GN = nn.Parameter(torch.zeros([1, 1, self.image_dim_out * 4]))
            self.sub_GN = nn.Parameter(torch.zeros([1, 1, 1, self.image_dim_out * 4]))
        width = self.image_dim_out * 4 if self.use_hd_transform else self.image_dim_out
        self.img_projection = nn.Sequential(
            nn.Linear(width, hidden_size), nn.GELU(), nn.Linear(hidden_size, hidden_size)
        )
        self.vocab_size = config.vocab_size

    def get_img_features(self, img_embeds):
        out = self.img_processor(img_embeds, output_hidden_states=True)
        return out.hidden_states[self.layer_idx][:, 1:]  # patch features, CLS dropped

    def forward(self, input_ids, pixel_values, image_sizes=None):
        input_shape = input_ids.size()
        input_ids = input_ids.view(-1, input_shape[-1])
        positions = torch.nonzero((input_ids < 0) & (input_ids > -MAX_INPUT_ID), as_tuple=True)
        has_image = len(positions[0].tolist()) > 0
        # as the real embedding does: the image ids are cleared in the caller's tensor
        input_ids.clamp_min_(0).clamp_max_(self.vocab_size)
        hidden_states = self.wte(input_ids)
        if has_image:  # the vision tower runs only for a batch with image tokens
            assert self.use_hd_transform
            num_images, num_crops, c, h, w = pixel_values.shape
            assert c == 3 and h == w == self.crop_size
            features = self.get_img_features(pixel_values.flatten(0, 1)).reshape(
                num_images, num_crops, -1, self.image_dim_out
            )
            projected = self.hd_feature_transform(features, image_sizes)
            hidden_states = hidden_states.index_put(positions, projected, accumulate=False)
        return self.drop(hidden_states)

    def hd_feature_transform(self, image_features, image_sizes):
        assert self.hd_transform_order == "sub_glb"
        dtype = self.img_projection[0].bias.dtype
        global_features = self.add_image_newline(self.reshape_hd_patches_2x2merge(image_features[:, 0], 1, 1))
        embeddings = []
        for i, (h, w) in enumerate(image_sizes.tolist()):
            h_crop, w_crop = h // self.crop_size, w // self.crop_size
            sub = image_features[i, 1 : 1 + h_crop * w_crop]
            sub = self.add_image_newline(self.reshape_hd_patches_2x2merge(sub, h_crop, w_crop))
            embeddings += [sub.squeeze(0), self.glb_GN.squeeze(0), global_features[i]]
        return self.img_projection(torch.cat(embeddings, dim=0).to(dtype))

    def reshape_hd_patches_2x2merge(self, image_features, h_crop, w_crop):
        n, length, c = image_features.shape
        g = self.grid
        assert length == g * g and n % (h_crop * w_crop) == 0
        num_images = n // (h_crop * w_crop)
        return (
            image_features.reshape(n, g // 2, 2, g // 2, 2, c)
            .permute(0, 1, 3, 2, 4, 5)
            .reshape(num_images, h_crop, w_crop, g // 2, g // 2, 4 * c)
            .permute(0, 1, 3, 2, 4, 5)
            .reshape(num_images, h_crop * g // 2, w_crop * g // 2, 4 * c)
        )

    def add_image_newline(self, features):
        num_images, h, w, c = features.shape
        newline = self.sub_GN.expand(num_images, h, -1, -1)
        return torch.cat([features, newline], dim=2).reshape(num_images, -1, c)
'''

MODELING = '''"""Phi-3-vision-like model (raylora test fixture), written against transformers 4's cache API as the
real modeling_phi3_v.py is."""

import math
from typing import List, Optional

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel

from .configuration_phi3_v import Phi3VConfig
from .image_embedding_phi3_v import Phi3ImageEmbedding

try:  # as the real file: the flash-attention classes need it, the eager ones do not
    from flash_attn import flash_attn_func  # noqa: F401
except ImportError:
    pass


class Phi3RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(dtype)


class Phi3RotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        self.dim, self.base = dim, base

    @torch.no_grad()
    def forward(self, x, position_ids, seq_len=None):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.int64).float().to(x.device) / self.dim))
        freqs = (inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1) @ position_ids[:, None, :].float())
        emb = torch.cat((freqs.transpose(1, 2), freqs.transpose(1, 2)), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class Phi3MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.activation_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states):
        gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


class Phi3Attention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.attention_dropout = config.attention_dropout
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        op_size = self.num_heads * self.head_dim + 2 * (self.num_key_value_heads * self.head_dim)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.qkv_proj = nn.Linear(self.hidden_size, op_size, bias=False)
        self.rotary_emb = Phi3RotaryEmbedding(self.head_dim, config.max_position_embeddings, config.rope_theta)

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        past_key_value: Optional[Cache] = None,
        output_attentions=False,
        use_cache=False,
    ):
        bsz, q_len, _ = hidden_states.size()
        qkv = self.qkv_proj(hidden_states)
        query_pos = self.num_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        query_states = qkv[..., :query_pos].view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = qkv[..., query_pos : query_pos + kv].view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        value_states = qkv[..., query_pos + kv :].view(bsz, q_len, -1, self.head_dim).transpose(1, 2)

        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value.get_usable_length(kv_seq_len, self.layer_idx)
        cos, sin = self.rotary_emb(value_states, position_ids, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)
        if past_key_value is not None:
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx, {"sin": sin, "cos": cos})
        groups = self.num_heads // self.num_key_value_heads
        key_states = key_states.repeat_interleave(groups, dim=1)
        value_states = value_states.repeat_interleave(groups, dim=1)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(value_states.dtype)
        attn_weights = nn.functional.dropout(attn_weights, p=self.attention_dropout, training=self.training)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), (attn_weights if output_attentions else None), past_key_value


class Phi3FlashAttention2(Phi3Attention):
    def forward(self, *args, **kwargs):
        raise NotImplementedError("the test fixture has no flash-attention path")


PHI3_ATTENTION_CLASSES = {"eager": Phi3Attention, "flash_attention_2": Phi3FlashAttention2}


class Phi3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = PHI3_ATTENTION_CLASSES[config._attn_implementation](config, layer_idx=layer_idx)
        self.mlp = Phi3MLP(config)
        self.input_layernorm = Phi3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.resid_attn_dropout = nn.Dropout(config.resid_pdrop)
        self.resid_mlp_dropout = nn.Dropout(config.resid_pdrop)
        self.post_attention_layernorm = Phi3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, **kwargs):
        residual = hidden_states
        attn_outputs, self_attn_weights, present_key_value = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_value=past_key_value,
            output_attentions=output_attentions,
            use_cache=use_cache,
        )
        hidden_states = residual + self.resid_attn_dropout(attn_outputs)
        residual = hidden_states
        hidden_states = residual + self.resid_mlp_dropout(self.mlp(self.post_attention_layernorm(hidden_states)))
        outputs = (hidden_states,)
        if output_attentions:
            outputs += (self_attn_weights,)
        if use_cache:
            outputs += (present_key_value,)
        return outputs


class Phi3VPreTrainedModel(PreTrainedModel):
    config_class = Phi3VConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Phi3DecoderLayer"]
    _skip_keys_device_placement = "past_key_values"
    _supports_flash_attn_2 = True
    _supports_sdpa = False
    _supports_cache_class = True

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=std)


class Phi3VModel(Phi3VPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.embed_dropout = nn.Dropout(config.embd_pdrop)
        self.vision_embed_tokens = None
        if isinstance(config.embd_layer, dict):
            self.vision_embed_tokens = Phi3ImageEmbedding(config, wte=self.embed_tokens, **config.embd_layer)
        self.layers = nn.ModuleList([Phi3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self._attn_implementation = config._attn_implementation
        self.norm = Phi3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values: Optional[List[torch.FloatTensor]] = None,
        inputs_embeds=None,
        pixel_values=None,
        image_sizes=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
    ):
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        output_hidden_states = output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        return_dict = return_dict if return_dict is not None else self.config.use_return_dict
        if input_ids is not None:
            batch_size, seq_length = input_ids.shape[:2]
        else:
            batch_size, seq_length = inputs_embeds.shape[:2]

        past_key_values_length = 0
        if self.gradient_checkpointing and self.training:
            use_cache = False
        if use_cache:
            use_legacy_cache = not isinstance(past_key_values, Cache)
            if use_legacy_cache:
                past_key_values = DynamicCache.from_legacy_cache(past_key_values)
            past_key_values_length = past_key_values.get_usable_length(seq_length)

        if position_ids is None:
            device = input_ids.device if input_ids is not None else inputs_embeds.device
            position_ids = torch.arange(past_key_values_length, seq_length + past_key_values_length, dtype=torch.long, device=device)
            position_ids = position_ids.unsqueeze(0).view(-1, seq_length)
        else:
            position_ids = position_ids.view(-1, seq_length).long()

        if inputs_embeds is None:
            if pixel_values is not None and image_sizes is not None:
                inputs_embeds = self.vision_embed_tokens(input_ids, pixel_values=pixel_values, image_sizes=image_sizes)
            else:
                inputs_embeds = self.embed_tokens(input_ids)

        attention_mask = _prepare_4d_causal_attention_mask(
            attention_mask, (batch_size, seq_length), inputs_embeds, past_key_values_length,
            sliding_window=self.config.sliding_window,
        )
        hidden_states = inputs_embeds
        all_hidden_states = () if output_hidden_states else None
        all_self_attns = () if output_attentions else None
        next_decoder_cache = None
        for decoder_layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            if self.gradient_checkpointing and self.training:
                layer_outputs = self._gradient_checkpointing_func(
                    decoder_layer.__call__, hidden_states, attention_mask, position_ids, past_key_values,
                    output_attentions, use_cache,
                )
            else:
                layer_outputs = decoder_layer(
                    hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                    past_key_value=past_key_values, output_attentions=output_attentions, use_cache=use_cache,
                )
            hidden_states = layer_outputs[0]
            if use_cache:
                next_decoder_cache = layer_outputs[2 if output_attentions else 1]
            if output_attentions:
                all_self_attns += (layer_outputs[1],)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        next_cache = None
        if use_cache:
            next_cache = next_decoder_cache.to_legacy_cache() if use_legacy_cache else next_decoder_cache
        if not return_dict:
            return tuple(v for v in [hidden_states, next_cache, all_hidden_states, all_self_attns] if v is not None)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states, past_key_values=next_cache,
            hidden_states=all_hidden_states, attentions=all_self_attns,
        )


class Phi3VForCausalLM(Phi3VPreTrainedModel):
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config):
        super().__init__(config)
        self.model = Phi3VModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def get_decoder(self):
        return self.model

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        pixel_values=None,
        image_sizes=None,
        labels=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
    ):
        return_dict = return_dict if return_dict is not None else self.config.use_return_dict
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, pixel_values=pixel_values,
            image_sizes=image_sizes, use_cache=use_cache, output_attentions=output_attentions,
            output_hidden_states=output_hidden_states, return_dict=return_dict,
        )
        hidden_states = outputs[0]
        logits = self.lm_head(hidden_states)
        logits = logits.float()
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[..., :-1, :].reshape(-1, self.config.vocab_size), labels[..., 1:].reshape(-1))
        if not return_dict:
            output = (logits,) + outputs[1:]
            return (loss,) + output if loss is not None else output
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states, attentions=outputs.attentions,
        )

    def prepare_inputs_for_generation(
        self, input_ids, past_key_values=None, attention_mask=None, inputs_embeds=None, pixel_values=None,
        image_sizes=None, **kwargs
    ):
        if past_key_values is not None:
            if isinstance(past_key_values, Cache):
                cache_length = past_key_values.get_seq_length()
                past_length = past_key_values.seen_tokens
                max_cache_length = past_key_values.get_max_length()
            else:
                cache_length = past_length = past_key_values[0][0].shape[2]
                max_cache_length = None
            if attention_mask is not None and attention_mask.shape[1] > input_ids.shape[1]:
                input_ids = input_ids[:, -(attention_mask.shape[1] - past_length) :]
            elif past_length < input_ids.shape[1]:
                input_ids = input_ids[:, past_length:]
            if (
                max_cache_length is not None
                and attention_mask is not None
                and cache_length + input_ids.shape[1] > max_cache_length
            ):
                attention_mask = attention_mask[:, -max_cache_length:]

        position_ids = kwargs.get("position_ids", None)
        if attention_mask is not None and position_ids is None:
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            if past_key_values:
                position_ids = position_ids[:, -input_ids.shape[1] :]

        if inputs_embeds is not None and past_key_values is None:
            model_inputs = {"inputs_embeds": inputs_embeds}
        else:
            model_inputs = {"input_ids": input_ids}
        model_inputs.update(
            {
                "position_ids": position_ids,
                "past_key_values": past_key_values,
                "use_cache": kwargs.get("use_cache"),
                "attention_mask": attention_mask,
                "pixel_values": pixel_values,
                "image_sizes": image_sizes,
            }
        )
        return model_inputs
'''

IMAGE_PROCESSING = '''"""Phi-3-vision-like image processor (raylora test fixture): HD transform with torchvision."""

import numpy as np
import torch
import torchvision
from PIL import Image
from transformers import AutoImageProcessor
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, make_list_of_images


def padding_to_crop(b, crop):
    width, height = b.size
    target = int(np.ceil(height / crop) * crop)
    top = int((target - height) / 2)
    return torchvision.transforms.functional.pad(b, [0, top, 0, target - height - top], fill=[255, 255, 255])


def HD_transform(img, hd_num, crop):
    width, height = img.size
    transposed = width < height
    if transposed:
        img = img.transpose(Image.TRANSPOSE)
        width, height = img.size
    ratio = width / height
    scale = 1
    while scale * np.ceil(scale / ratio) <= hd_num:
        scale += 1
    scale -= 1
    new_w = int(scale * crop)
    new_h = int(new_w / ratio)
    img = torchvision.transforms.functional.resize(img, [new_h, new_w])
    img = padding_to_crop(img, crop)
    if transposed:
        img = img.transpose(Image.TRANSPOSE)
    return img


class Phi3VImageProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values"]

    def __init__(self, num_crops=1, crop_size=336, num_img_tokens=144, image_mean=None, image_std=None,
                 do_convert_rgb=True, **kwargs):
        super().__init__(**kwargs)
        self.num_crops = num_crops
        self.crop_size = crop_size
        self.num_img_tokens = num_img_tokens  # tokens of one crop after the 2x2 merge
        self.image_mean = image_mean if image_mean is not None else OPENAI_CLIP_MEAN
        self.image_std = image_std if image_std is not None else OPENAI_CLIP_STD
        self.do_convert_rgb = do_convert_rgb

    def preprocess(self, images, return_tensors=None, **kwargs):
        crop, side = self.crop_size, int(self.num_img_tokens ** 0.5)
        images = [image.convert("RGB") for image in make_list_of_images(images)]
        normalise = torchvision.transforms.Compose([
            torchvision.transforms.ToTensor(),
            torchvision.transforms.Normalize(self.image_mean, self.image_std),
        ])
        hd_images = [normalise(HD_transform(im, self.num_crops, crop)) for im in images]
        global_images = [
            torch.nn.functional.interpolate(im.unsqueeze(0).float(), size=(crop, crop), mode="bicubic").to(im.dtype)
            for im in hd_images
        ]
        shapes = [[im.size(1), im.size(2)] for im in hd_images]
        num_img_tokens = [int(((h // crop) * (w // crop) + 1) * self.num_img_tokens + 1 + (h // crop + 1) * side) for h, w in shapes]
        crops = [
            im.reshape(1, 3, h // crop, crop, w // crop, crop).permute(0, 2, 4, 1, 3, 5).reshape(-1, 3, crop, crop)
            for im, (h, w) in zip(hd_images, shapes)
        ]
        crops = [torch.cat([g, c], dim=0) for g, c in zip(global_images, crops)]
        most = self.num_crops + 1
        crops = [torch.cat([c, torch.zeros(most - len(c), 3, crop, crop, dtype=c.dtype)]) if len(c) < most else c for c in crops]
        data = {"pixel_values": torch.stack(crops), "image_sizes": shapes, "num_img_tokens": num_img_tokens}
        return BatchFeature(data=data, tensor_type=return_tensors)


AutoImageProcessor.register("Phi3VImageProcessor", Phi3VImageProcessor)
'''

PROCESSING = '''"""Phi-3-vision-like processor (raylora test fixture)."""

import re

import torch
import transformers
from transformers.feature_extraction_utils import BatchFeature
from transformers.processing_utils import ProcessorMixin
from transformers.utils import TensorType

from .image_processing_phi3_v import Phi3VImageProcessor

transformers.Phi3VImageProcessor = Phi3VImageProcessor


class Phi3VProcessor(ProcessorMixin):
    attributes = ["image_processor", "tokenizer"]
    image_processor_class = "Phi3VImageProcessor"
    tokenizer_class = ("LlamaTokenizer", "LlamaTokenizerFast")
    special_image_token = "<|image|>"

    def __init__(self, image_processor, tokenizer):
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.num_img_tokens = image_processor.num_img_tokens

    def __call__(self, text, images=None, padding=False, truncation=None, max_length=None,
                 return_tensors=TensorType.PYTORCH):
        image_inputs = self.image_processor(images, return_tensors=return_tensors) if images is not None else {}
        return self._convert_images_texts_to_inputs(image_inputs, text, padding=padding, truncation=truncation,
                                                    max_length=max_length, return_tensors=return_tensors)

    def _convert_images_texts_to_inputs(self, images, texts, padding=False, truncation=None, max_length=None,
                                        return_tensors=None):
        if not len(images):
            model_inputs = self.tokenizer(texts, return_tensors=return_tensors, padding=padding,
                                          truncation=truncation, max_length=max_length)
            return BatchFeature(data={**model_inputs})
        pattern = r"<\\|image_\\d+\\|>"
        prompt_chunks = [self.tokenizer(chunk).input_ids for chunk in re.split(pattern, texts)]
        num_img_tokens = images["num_img_tokens"]
        pixel_values, image_sizes = images["pixel_values"], images["image_sizes"]
        image_ids = [int(s.split("|")[1].split("_")[-1]) for s in re.findall(pattern, texts)]
        unique = sorted(set(image_ids))
        assert unique == list(range(1, len(unique) + 1)), unique
        assert len(unique) == len(pixel_values), (len(unique), len(pixel_values))
        image_ids_pad = [[-iid] * num_img_tokens[iid - 1] for iid in image_ids]
        input_ids = []
        for chunk, pad in zip(prompt_chunks, image_ids_pad + [[]]):
            input_ids.extend(chunk)
            input_ids.extend(pad)
        input_ids = torch.tensor(input_ids, dtype=torch.long).unsqueeze(0)
        attention_mask = (input_ids > -1000000).to(torch.long)
        return BatchFeature(data={"input_ids": input_ids, "attention_mask": attention_mask,
                                  "pixel_values": pixel_values, "image_sizes": image_sizes})

    def batch_decode(self, *args, **kwargs):
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)

    @property
    def model_input_names(self):
        return list(dict.fromkeys(self.tokenizer.model_input_names + self.image_processor.model_input_names))
'''

# Phi-3's chat turns, as the model card and the folder's tokenizer_config.json write them: content is
# concatenated as a string, every turn (the assistant's too) closed by <|end|> and a line break.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + '\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt and messages[-1]['role'] != 'assistant' %}"
    "{{- '<|assistant|>\\n' -}}{% endif %}"
)
SPECIAL = ("<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>")
# The crop (tile) and the CLIP tower are tiny where the real files fix 336 pixels and CLIP ViT-L/14-336:
# a 56-pixel crop in 14-pixel patches is a 4x4 grid, 2x2 after the merge: 4 tokens a crop.
CROP, PATCH = 56, 14


def make_phi3v_model(out: Path, width: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """Write the folder at `out`: config, code files, tokenizer, processor settings and random weights
    (safetensors, the image embedding's shared `wte` stored once as `model.embed_tokens.weight`, as the
    Hub's files store it). Built with the folder's own classes, imported from it without raylora."""
    import torch
    from safetensors.torch import save_file
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    from tests.real_tokenizers import sentencepiece_llama

    out.mkdir(parents=True, exist_ok=True)
    files = {
        "configuration_phi3_v.py": CONFIGURATION,
        "image_embedding_phi3_v.py": IMAGE_EMBEDDING,
        "modeling_phi3_v.py": MODELING,
        "image_processing_phi3_v.py": IMAGE_PROCESSING,
        "processing_phi3_v.py": PROCESSING,
    }
    for name, text in files.items():
        (out / name).write_text(text)
    tokenizer = sentencepiece_llama(extra_special=SPECIAL)
    tokenizer.eos_token, tokenizer.pad_token = "<|endoftext|>", "<|endoftext|>"
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    ids = tokenizer.convert_tokens_to_ids
    clip = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": CROP,
        "patch_size": PATCH,
        "projection_dim": 32,
        "hidden_act": "quick_gelu",
    }
    config = {
        "architectures": ["Phi3VForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_phi3_v.Phi3VConfig",
            "AutoModelForCausalLM": "modeling_phi3_v.Phi3VForCausalLM",
        },
        "model_type": "phi3_v",
        "vocab_size": len(tokenizer),
        "hidden_size": width,
        "intermediate_size": 2 * width,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
        "sliding_window": 4096,
        "bos_token_id": ids("<s>"),
        "eos_token_id": ids("<|endoftext|>"),
        "pad_token_id": ids("<|endoftext|>"),
        "embd_layer": {
            "embedding_cls": "image",
            "hd_transform_order": "sub_glb",
            "projection_cls": "mlp",
            "use_hd_transform": True,
            "with_learnable_separator": True,
        },
        "img_processor": {
            "name": "clip_vision_model",
            "image_dim_out": clip["hidden_size"],
            "num_img_tokens": (CROP // PATCH // 2) ** 2,
            "clip_config": clip,
        },
        "torch_dtype": "float32",
        "use_cache": True,
        "_attn_implementation": "flash_attention_2",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": ids("<s>"), "eos_token_id": [ids("<|endoftext|>"), ids("<|end|>")]})
    )
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "auto_map": {
                    "AutoProcessor": "processing_phi3_v.Phi3VProcessor",
                    "AutoImageProcessor": "image_processing_phi3_v.Phi3VImageProcessor",
                },
                "image_processor_type": "Phi3VImageProcessor",
                "processor_class": "Phi3VProcessor",
                "num_crops": 1,
                "crop_size": CROP,
                "num_img_tokens": (CROP // PATCH // 2) ** 2,
            },
            indent=2,
        )
    )
    config_cls = get_class_from_dynamic_module("configuration_phi3_v.Phi3VConfig", str(out))
    model_cls = get_class_from_dynamic_module("modeling_phi3_v.Phi3VForCausalLM", str(out))
    model_config = config_cls.from_pretrained(out)
    model_config._attn_implementation = "eager"  # only to build it here: the folder asks for flash
    torch.manual_seed(seed)
    model = model_cls(model_config)
    # the Hub's names: transformers 4's CLIPVisionModel had its modules under `vision_model` (5 maps them
    # back on load), and the shared `wte` is not stored
    state = {
        k.replace(".img_processor.", ".img_processor.vision_model."): v.contiguous()
        for k, v in model.state_dict().items()
        if k != "model.vision_embed_tokens.wte.weight"
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
