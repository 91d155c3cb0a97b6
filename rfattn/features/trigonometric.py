"""Trigonometric random features (TrigRF, random Fourier features; spec §2.3 option (b)).

``phi(x) = exp(|x|^2/2) / sqrt(M) [cos(omega_f . x), sin(omega_f . x)]_f`` (F = 2M), so that
``phi(x) . phi(y) = exp((|x|^2 + |y|^2)/2) (1/M) sum_f cos(omega_f . (x - y))`` estimates
``exp(|x|^2/2) exp(-|x - y|^2/2) exp(|y|^2/2) = exp(x . y)`` for omega ~ N(0, I). Eq 31 as printed
(cos for x, sin for y) has expectation 0; the paired [cos, sin] form is the corrected one.

Signed exponential form: ``u = |x|^2/2`` (the same for every feature; returned as an expanded
view), amplitude ``g = [cos(x W^T), sin(x W^T)]``. Not positive: the attention denominator can
vanish (policy: :func:`rfattn.reference.safe_denominator`), and the variance does not vanish
where the kernel does, which is why Spectraformer leaves it out of its experiments.
"""

from __future__ import annotations

import math

import torch

from rfattn.features.base import FeatureMap, component_weights, project, sq_norm
from rfattn.features.form import KernelForm, coefficient_table

__all__ = ["TrigRF"]


class TrigRF(FeatureMap):
    """``[cos, sin]`` random Fourier features scaled by ``exp(|x|^2/2)`` (softmax target)."""

    name = "trigrf"
    width_factor = 2
    positive = False

    def logits(self, x, w, side, params=None):
        u = 0.5 * sq_norm(x)
        return u.expand(*u.shape[:-1], 2 * w.shape[-2])

    def amplitude(self, x, w, side, params=None):
        z = project(x, w)
        return torch.cat((torch.cos(z), torch.sin(z)), dim=-1)

    def kernel_form(self, w, params=None):  # u = |x|^2 / 2, g = [cos z, sin z] = cos(z - [0, pi/2])
        m, dev = w.shape[0], w.device
        half = torch.ones(m, dtype=torch.float64, device=dev)
        c = component_weights(params, 2 * m)
        table = coefficient_table(
            2 * m,
            dev,
            ch=0.5,
            ct=1.0,
            tb=torch.cat((0.0 * half, -0.5 * math.pi * half)),
            gb=(1.0, 1.0 if c is None else c.to(dev, torch.float64)),
        )
        return KernelForm("table", torch.cat((w, w), dim=0), table=table)
