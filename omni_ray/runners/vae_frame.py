"""Qwen-Image's VAE on still images: the video VAE's first frame, computed with 2-D kernels.

Qwen-Image's VAE is Wan's causal video VAE. A still image is a video of one frame, and on the first frame the video
model does less than its layers suggest: every causal ``3x3x3`` convolution pads time with two zero frames in front,
so its first two temporal taps only ever multiply zeros and it equals a ``3x3`` convolution with the last tap's
weights; the temporal up- and down-sampling convolutions are skipped on a first frame (diffusers marks their cache
"Rep" or fills it); attention and the spatial resampling already run per frame. ``FrameDecoder`` and
``FrameEncoder`` are that arithmetic, built from a loaded ``AutoencoderKLQwenImage``'s weights: the same operations on
the same values, without the 3-D convolutions' padding copies and their slower kernels (``benchmarks/results/vae.json``,
the small VAE at 256x256 on the 2-core Xeon: 12.3x faster than diffusers' decode at batch 1, where PyTorch's CPU
conv3d takes its slow path, 4.6x and 5.9x at batch 2 and 4).

What they return is what diffusers' ``decode(...).sample[:, :, 0]`` and ``encode(...).latent_dist.mode()`` return;
the kernels differ, so float sums may round differently (the pixels stay within one uint8 level; see the tests).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLQwenImage
from torch import nn


def _conv2d(conv: nn.Conv3d) -> nn.Conv2d:
    """The 2-D convolution a causal 3-D one computes on a first frame: its last temporal tap (the only one that
    does not see the zero padding), its spatial padding and stride."""
    _, _, taps, kernel_h, kernel_w = conv.weight.shape
    padding = conv._padding  # diffusers' causal padding: (w, w, h, h, 2 * t, 0)
    assert padding[0] == padding[1] and padding[2] == padding[3] and padding[4] == 2 * (taps // 2), "not causal"
    out = nn.Conv2d(conv.in_channels, conv.out_channels, (kernel_h, kernel_w), stride=conv.stride[1:],
                    padding=(padding[2], padding[0]), device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(conv.weight[:, :, -1])
        out.bias.copy_(conv.bias)
    return out


class _RMSNorm(nn.Module):
    """Qwen-Image's channel RMS norm on ``[B, C, H, W]``: L2-normalised over channels, in float32 for half types."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.scale = norm.scale
        self.gamma = nn.Parameter(norm.gamma.detach().reshape(-1, 1, 1).clone())
        self.bias = nn.Parameter(norm.bias.detach().reshape(-1, 1, 1).clone()) if torch.is_tensor(norm.bias) else 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        upcast = x.dtype in (torch.float16, torch.bfloat16)
        normalized = F.normalize(x.float() if upcast else x, dim=1).to(x.dtype)
        return normalized * self.scale * self.gamma + self.bias


class _ResidualBlock(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.norm1, self.conv1 = _RMSNorm(block.norm1), _conv2d(block.conv1)
        self.norm2, self.conv2 = _RMSNorm(block.norm2), _conv2d(block.conv2)
        shortcut = block.conv_shortcut
        self.shortcut = _conv2d(shortcut) if isinstance(shortcut, nn.Conv3d) else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shortcut(x)
        x = self.conv1(F.silu(self.norm1(x)))
        x = self.conv2(F.silu(self.norm2(x)))  # dropout is 0 at inference
        return x + h


class _Attention(nn.Module):
    """Single-head self-attention over an image's positions."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.norm, self.to_qkv, self.proj = _RMSNorm(block.norm), copy.deepcopy(block.to_qkv), copy.deepcopy(block.proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = x.shape
        qkv = self.to_qkv(self.norm(x)).reshape(batch, 1, channels * 3, height * width)
        q, k, v = qkv.permute(0, 1, 3, 2).contiguous().chunk(3, dim=-1)  # each [B, 1, H*W, C]
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.squeeze(1).permute(0, 2, 1).reshape(batch, channels, height, width)) + x


class _Resample(nn.Module):
    """2x nearest-exact upsampling then a convolution, or a right/bottom zero pad then a stride-2 convolution; the
    temporal convolutions of the ``*3d`` modes do nothing on a first frame."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.up = block.mode.startswith("upsample")
        self.conv = copy.deepcopy(block.resample[1])  # its own: the layout change must not reach the VAE given

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.up:
            return self.conv(F.interpolate(x.float(), scale_factor=2.0, mode="nearest-exact").type_as(x))
        return self.conv(F.pad(x, (0, 1, 0, 1)))


def _layer(module: nn.Module) -> nn.Module:
    kind = type(module).__name__
    if kind == "QwenImageResidualBlock":
        return _ResidualBlock(module)
    if kind == "QwenImageAttentionBlock":
        return _Attention(module)
    if kind == "QwenImageResample":
        if module.mode == "none":
            return nn.Identity()
        return _Resample(module)
    raise TypeError(f"no single-frame form for {kind}")


def _mid_layers(mid: nn.Module) -> list[nn.Module]:
    layers = [_layer(mid.resnets[0])]
    for attention, resnet in zip(mid.attentions, mid.resnets[1:]):
        layers += [_layer(attention), _layer(resnet)]
    return layers


class FrameDecoder(nn.Module):
    """Normalised latents ``[B, z_dim, h, w]`` -> pixels in [-1, 1] ``[B, C, 8h, 8w]`` (C: the VAE's image
    channels, 3, or 4 for Qwen-Image-Layered's RGBA; each of a batch's rows a frame of its own).

    Its head (``post_quant_conv``, ``conv_in`` and the mid block, whose attention spans the whole frame) runs at the
    latent resolution; everything after it (the up blocks' residual blocks and upsamplers, ``norm_out``,
    ``conv_out``) is convolutions and per-position norms, so a band of latent rows' pixels depends only on the head's
    output in those rows and ``halo`` rows either side. ``decode_rows`` computes a band so: the frame's pixels as the
    whole-frame decode computes them (float rounding aside: the convolutions see other shapes), in a fraction of its
    activation memory.
    """

    def __init__(self, vae: AutoencoderKLQwenImage):
        super().__init__()
        decoder = vae.decoder
        self.head = nn.Sequential(_conv2d(vae.post_quant_conv), _conv2d(decoder.conv_in),
                                  *_mid_layers(decoder.mid_block))
        up = []
        for block in decoder.up_blocks:
            up += [_layer(resnet) for resnet in block.resnets]
            up += [_layer(upsampler) for upsampler in block.upsamplers or ()]
        self.up = nn.Sequential(*up)
        self.norm_out, self.conv_out = _RMSNorm(decoder.norm_out), _conv2d(decoder.conv_out)
        self.scale = 2 ** sum(isinstance(layer, _Resample) for layer in up)  # pixel rows per latent row
        self.halo = _halo_rows([*up, self.conv_out])

    def forward(self, latents: torch.Tensor, band_rows: int | None = None) -> torch.Tensor:
        """The frame's pixels; with ``band_rows``, its up path run on bands of that many latent rows (or a few
        fewer: the bands are of even heights) one after another."""
        hidden = self.head(latents)
        return self.decode_rows(hidden, 0, hidden.shape[2], band_rows)

    def decode_rows(self, hidden: torch.Tensor, start: int, stop: int, band_rows: int | None = None
                    ) -> torch.Tensor:
        """Pixels ``[B, C, scale * (stop - start), scale * w]`` of latent rows ``[start, stop)`` from the head's
        output ``hidden`` ``[B, C, h, w]``: the up path on those rows and ``halo`` more either side (fewer at the
        frame's edges, where the whole-frame decode's zero padding is the same), then cropped to them. With
        ``band_rows``, band by band."""
        if band_rows is not None and stop - start > band_rows:
            bands = split_rows(stop - start, -(-(stop - start) // band_rows))
            return torch.cat([self.decode_rows(hidden, start + a, start + b) for a, b in bands], dim=2)
        top, bottom = max(start - self.halo, 0), min(stop + self.halo, hidden.shape[2])
        x = self.conv_out(F.silu(self.norm_out(self.up(hidden[:, :, top:bottom]))))
        return x[:, :, self.scale * (start - top):self.scale * (stop - top)].clamp(-1.0, 1.0)


def split_rows(height: int, parts: int) -> list[tuple[int, int]]:
    """``[0, height)`` in ``parts`` consecutive ``(start, stop)`` ranges whose sizes differ by one at most, the
    longer first."""
    size, extra = divmod(height, parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _halo_rows(layers: list[nn.Module]) -> int:
    """Latent rows of context either side that exact pixels of a band of latent rows need after ``layers`` (the
    decoder's up path): the path's receptive field, walked back from the output. Each 3x3 convolution reaches one
    row further at its resolution; a 2x nearest upsampling halves the reach, rounded up (bands start on latent
    rows, so on even rows at every finer resolution)."""
    reach = 0
    for layer in reversed(layers):
        if isinstance(layer, nn.Conv2d):
            assert layer.stride[0] == 1, "a strided convolution in the up path"
            reach += layer.padding[0]
        elif isinstance(layer, _ResidualBlock):  # its shortcut is 1x1: the convolutions reach further
            reach += layer.conv1.padding[0] + layer.conv2.padding[0]
        elif isinstance(layer, _Resample) and layer.up:
            reach = -(-(reach + layer.conv.padding[0]) // 2)
        elif not isinstance(layer, nn.Identity):
            raise TypeError(f"{type(layer).__name__} in the decoder's up path: rows would not be local")
    return reach


def _down_halo_rows(layers: list[nn.Module], scale: int) -> int | None:
    """Pixel rows of context either side that exact latents of a band need in the encoder's down path (``layers``),
    a multiple of ``scale`` (bands start on latent rows): its receptive field, walked back from the output. A 3x3
    convolution reaches one row further at its resolution; a stride-2 downsampler (zero row padded below, then a 3x3
    convolution of stride 2) doubles the reach and adds its kernel's two rows. None if a layer is not local."""
    reach = 0
    for layer in reversed(layers):
        if isinstance(layer, _Resample) and not layer.up:
            reach = 2 * reach + layer.conv.kernel_size[0] - 1
        elif isinstance(layer, nn.Conv2d):
            reach += layer.padding[0]
        elif isinstance(layer, _ResidualBlock):  # its shortcut is 1x1: the convolutions reach further
            reach += layer.conv1.padding[0] + layer.conv2.padding[0]
        elif not isinstance(layer, nn.Identity):
            return None
    return -(-reach // scale) * scale


class FrameEncoder(nn.Module):
    """Pixels in [-1, 1] ``[B, C, H, W]`` (C: 3, or 4 for RGBA) -> the latent distribution's moments
    ``[B, 2 * z_dim, H/8, W/8]``: its mean (its mode), then its log-variance.

    Its down path (``conv_in``, the down blocks' residual blocks and stride-2 downsamplers) is convolutions and
    per-position norms, so a band of latent rows depends only on the pixel rows under it and ``halo`` more either
    side; the mid block (whose attention spans the frame) and the output layers run at the latent resolution on the
    whole frame. With ``band_rows``, the down path runs band by band (``encode_rows``): the whole-frame encode's
    latents (float rounding aside) in a fraction of its full-resolution activations. A VAE whose down blocks attend
    (none published) has no bands (``halo`` None)."""

    def __init__(self, vae: AutoencoderKLQwenImage):
        super().__init__()
        encoder = vae.encoder
        self.down = nn.Sequential(_conv2d(encoder.conv_in), *(_layer(layer) for layer in encoder.down_blocks))
        self.mid = nn.Sequential(*_mid_layers(encoder.mid_block))
        self.norm_out, self.conv_out = _RMSNorm(encoder.norm_out), _conv2d(encoder.conv_out)
        self.quant_conv = _conv2d(vae.quant_conv)
        self.z_dim = vae.config.z_dim
        self.scale = 2 ** sum(isinstance(layer, _Resample) for layer in self.down)  # pixel rows per latent row
        self.halo = _down_halo_rows(list(self.down), self.scale)

    def forward(self, pixels: torch.Tensor, band_rows: int | None = None) -> torch.Tensor:
        rows = pixels.shape[2] // self.scale
        if band_rows is None or rows <= band_rows or self.halo is None:
            hidden = self.down(pixels)
        else:
            hidden = torch.cat([self.encode_rows(pixels, a, b) for a, b in split_rows(rows, -(-rows // band_rows))],
                               dim=2)
        return self.quant_conv(self.conv_out(F.silu(self.norm_out(self.mid(hidden)))))

    def encode_rows(self, pixels: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """The down path's output for latent rows ``[start, stop)``: run on their pixel rows and ``halo`` more
        either side (fewer at the frame's edges, where the whole-frame encode's padding is the same), then cropped.
        The band starts on a multiple of ``scale`` pixel rows, so every stride-2 convolution samples the rows the
        whole frame's samples."""
        top = max(self.scale * start - self.halo, 0)
        bottom = min(self.scale * stop + self.halo, pixels.shape[2])
        hidden = self.down(pixels[:, :, top:bottom])
        first = start - top // self.scale
        return hidden[:, :, first:first + stop - start]
