"""Tests of optim.py: FP4 optimizer states, AdamW, Newton-Schulz, Muon/ROOT, build."""
import pytest
import torch

import optim

# ---------------------------------------------------------------------------------------------
# FP4 states and AdamW


# ---------------------------------------------------------------------------------------------
# Newton-Schulz, Muon and ROOT


# ---------------------------------------------------------------------------------------------
# build and state_bytes
