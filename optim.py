"""
Optimizers for FP4 pretraining (SPEC.md 8.1-8.2): AdamW with FP4 (NVFP4) states, and the
Muon family (Muon, ROOT) whose Newton-Schulz iteration can run its GEMMs in NVFP4.

Read top to bottom: the FP4 state quantizer (shared by every optimizer here), AdamW, Newton-Schulz
and Muon/ROOT, then build() and state_bytes().
"""
import torch

import fp4

# ---------------------------------------------------------------------------------------------
# FP4 optimizer states (SPEC 8.1): the quantizer every optimizer here stores its states with
#
# Contract (used by AdamW and by ROOT's optional NVFP4 momentum):
#   quantize_state(x, kind, seed) -> an object holding the packed state (kind 'signed' for a first
#       moment / momentum, 'sqrt' for a second moment stored as sqrt(v)); it is what state_dict()
#       holds; dequantize_state(s) -> FP32 tensor of x's shape; state_nbytes(s) -> bytes it holds.
# PLACEHOLDER until the AdamW-FP4 work lands: an FP32 copy (no quantization).


def quantize_state(x, kind="signed", seed=0):
    return x.detach().float().clone()


def dequantize_state(s):
    return s


def state_nbytes(s):
    return s.numel() * s.element_size()


# ---------------------------------------------------------------------------------------------
# AdamW (SPEC 8.1)


# ---------------------------------------------------------------------------------------------
# Newton-Schulz, Muon and ROOT (SPEC 8.2)


# ---------------------------------------------------------------------------------------------
# build(model, name) and state_bytes(optimizer)
