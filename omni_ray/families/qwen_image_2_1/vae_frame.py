"""Qwen-Image 2.1's VAE on one image, as plain 2-D modules: ``AutoencoderKLQwenImage21``'s arithmetic on its single
frame, without the video model's frame axis.

2.1's VAE is already written for images: its "causal 3-D" convolutions are ``nn.Conv2d`` that squeeze the frame axis
and pad explicitly, and its temporal up- and down-sampling convolutions do nothing on a first frame. What remains of
the video model on one frame is bookkeeping: a copy of every convolution's input into the feature cache
(``_decode``/``_encode`` keep one for the next chunk, which a still image never has), an explicit ``F.pad`` copy
before each 3x3 convolution, 5-D permutes around the resamplers and attention, and two residual shortcuts that see
time:

- ``QwenImage21AvgDown3D`` with a temporal factor pads a zero frame in front of the one frame and averages groups of
  channels x (zero frame, frame) x 2x2 positions: the zeros count in the mean (``_AvgDown``);
- ``QwenImage21DupUp3D`` with a temporal factor duplicates channels into two frames and keeps the second on a first
  chunk (``_DupUp``).

``FrameDecoder21`` and ``FrameEncoder21`` compute that arithmetic from a loaded VAE's weights (copies: the VAE given
is left as it was), reusing ``vae_frame``'s norm, attention and resampler, whose forms are 2.1's too. Their outputs
are diffusers' ``decode(...).sample[:, :, 0]`` and ``encode(...).latent_dist``'s moments within float rounding (the
convolutions pad inside the kernel instead of before it; tests/test_vae21.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni_ray.runners.vae_frame import _Attention, _Resample, _RMSNorm


def _conv2d(conv: nn.Conv2d) -> nn.Conv2d:
    """A plain ``nn.Conv2d`` computing what ``QwenImage21CausalConv3d`` computes on one frame: its weights, with its
    explicit padding ``(w, w, h, h)`` moved into the kernel."""
    padding = conv._padding
    assert len(padding) == 4 and padding[0] == padding[1] and padding[2] == padding[3], "not a symmetric padding"
    out = nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride,
                    padding=(padding[2], padding[0]), device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(conv.weight)
        out.bias.copy_(conv.bias)
    return out


class _ResidualBlock(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.norm1, self.conv1 = _RMSNorm(block.norm1), _conv2d(block.conv1)
        self.norm2, self.conv2 = _RMSNorm(block.norm2), _conv2d(block.conv2)
        shortcut = block.conv_shortcut
        self.shortcut = _conv2d(shortcut) if isinstance(shortcut, nn.Conv2d) else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shortcut(x)
        x = self.conv1(F.silu(self.norm1(x)))
        x = self.conv2(F.silu(self.norm2(x)))  # dropout is 0 at inference
        return x + h


class _AvgDown(nn.Module):
    """``QwenImage21AvgDown3D`` on one frame: the frame's ``factor_s x factor_s`` positions as channels, behind
    ``factor_t - 1`` zero frames (the causal front padding), averaged in groups into ``out_channels``."""

    def __init__(self, shortcut: nn.Module):
        super().__init__()
        self.factor_t, self.factor_s = shortcut.factor_t, shortcut.factor_s
        self.out_channels, self.group_size = shortcut.out_channels, shortcut.group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = x.shape
        s = self.factor_s
        h, w = height // s, width // s
        x = x.view(batch, channels, 1, h, s, w, s).permute(0, 1, 2, 4, 6, 3, 5)  # [B, C, 1, s, s, h, w]
        if self.factor_t > 1:
            zeros = x.new_zeros(batch, channels, self.factor_t - 1, s, s, h, w)
            x = torch.cat([zeros, x], dim=2)
        return x.reshape(batch, self.out_channels, self.group_size, h, w).mean(dim=2)


class _DupUp(nn.Module):
    """``QwenImage21DupUp3D`` on a first chunk: channels repeated into ``factor_t`` frames of ``factor_s x
    factor_s`` positions, of which the last frame is kept."""

    def __init__(self, shortcut: nn.Module):
        super().__init__()
        self.factor_t, self.factor_s = shortcut.factor_t, shortcut.factor_s
        self.out_channels, self.repeats = shortcut.out_channels, shortcut.repeats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = x.shape
        s = self.factor_s
        x = x.repeat_interleave(self.repeats, dim=1).view(batch, self.out_channels, self.factor_t, s, s, height, width)
        x = x[:, :, -1].permute(0, 1, 4, 2, 5, 3)  # [B, C, h, s, w, s]
        return x.reshape(batch, self.out_channels, height * s, width * s)


class _UpBlock(nn.Module):
    """``QwenImage21ResidualUpBlock``: residual blocks and the upsampler, beside the duplicating shortcut."""

    def __init__(self, block: nn.Module):
        super().__init__()
        layers = [_ResidualBlock(resnet) for resnet in block.resnets]
        if block.upsampler is not None:
            layers.append(_Resample(block.upsampler))
        self.layers = nn.Sequential(*layers)
        self.shortcut = _DupUp(block.avg_shortcut) if block.avg_shortcut is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(x)
        return out + self.shortcut(x) if self.shortcut is not None else out


class _DownBlock(nn.Module):
    """``QwenImage21ResidualDownBlock``: residual blocks and the downsampler, beside the averaging shortcut."""

    def __init__(self, block: nn.Module):
        super().__init__()
        layers = [_ResidualBlock(resnet) for resnet in block.resnets]
        if block.downsampler is not None:
            layers.append(_Resample(block.downsampler))
        self.layers = nn.Sequential(*layers)
        self.shortcut = _AvgDown(block.avg_shortcut)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x) + self.shortcut(x)


def _mid_layers(mid: nn.Module) -> list[nn.Module]:
    layers = [_ResidualBlock(mid.resnets[0])]
    for attention, resnet in zip(mid.attentions, mid.resnets[1:]):
        layers += [_Attention(attention), _ResidualBlock(resnet)]
    return layers


def check_image_vae(vae: nn.Module) -> None:
    """Raises ValueError unless ``vae`` is a 2.1 VAE these modules compute: residual blocks, no patching."""
    if not vae.config.is_residual:
        raise ValueError("the VAE's blocks are not residual (is_residual: false): not Qwen-Image 2.1's")
    if vae.config.patch_size not in (None, 1):
        raise ValueError(f"the VAE patchifies its input (patch_size {vae.config.patch_size}): not Qwen-Image 2.1's")


class FrameDecoder21(nn.Module):
    """Denormalised latents ``[B, z_dim, h, w]`` -> pixels in [-1, 1] ``[B, out_channels, 16h, 16w]`` (RGBA)."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        check_image_vae(vae)
        decoder = vae.decoder
        self.layers = nn.Sequential(_conv2d(vae.post_quant_conv), _conv2d(decoder.conv_in),
                                    *_mid_layers(decoder.mid_block), *(_UpBlock(b) for b in decoder.up_blocks))
        self.norm_out, self.conv_out = _RMSNorm(decoder.norm_out), _conv2d(decoder.conv_out)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.conv_out(F.silu(self.norm_out(self.layers(latents)))).clamp(-1.0, 1.0)


class FrameEncoder21(nn.Module):
    """Pixels in [-1, 1] ``[B, in_channels, H, W]`` (RGBA) -> the latent distribution's moments
    ``[B, 2 * z_dim, H/16, W/16]``: its mean (its mode), then its log-variance."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        check_image_vae(vae)
        encoder = vae.encoder
        self.layers = nn.Sequential(_conv2d(encoder.conv_in), *(_DownBlock(b) for b in encoder.down_blocks),
                                    *_mid_layers(encoder.mid_block))
        self.norm_out, self.conv_out = _RMSNorm(encoder.norm_out), _conv2d(encoder.conv_out)
        self.quant_conv = _conv2d(vae.quant_conv)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.quant_conv(self.conv_out(F.silu(self.norm_out(self.layers(pixels)))))
