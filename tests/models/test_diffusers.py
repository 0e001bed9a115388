"""diffusers VAEs, tiny random configs: Wan 2.1's video VAE (causal 3-D
convolutions: each pads its input in time on one side with F.pad, and
caches frames between chunks) and the image AutoencoderKL (its
downsampling pads asymmetrically with F.pad), encode and decode, against
stock torch and float64."""

import copy

import pytest
import torch

from mps_ext_executor import run_model
from model_compare import RELEASE

import diffusers


def encode_decode(vae, x):
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mode()
        return z, vae.decode(z).sample


def check_vae(figures, vae, x, dtype, families):
    ref = encode_decode(copy.deepcopy(vae).double(), x.double())
    vae, x = vae.to(dtype), x.to(dtype)
    stock = encode_decode(vae, x)
    with run_model(RELEASE) as report:
        ours = encode_decode(vae, x)
    figures.ran(report, families)
    figures.no_worse("latent", ours[0], stock[0], ref[0], dtype)
    figures.no_worse("decoded", ours[1], stock[1], ref[1], dtype)
    return report


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_wan_video_vae(figures, dtype):
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1,
                                     temperal_downsample=[True], latents_mean=[0.0] * 4,
                                     latents_std=[1.0] * 4).eval()
    video = torch.randn(1, 3, 5, 8, 8)  # 1 + 4k frames: the first alone, then chunks of 4
    report = check_vae(figures, vae, video, dtype, {"pad"})
    assert report.families["pad"].left_to_torch == {}


def test_image_vae(figures):
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(down_block_types=["DownEncoderBlock2D"] * 2,
                                  up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 16],
                                  layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=16).eval()
    check_vae(figures, vae, torch.randn(1, 3, 16, 16), torch.float32, {"pad"})
