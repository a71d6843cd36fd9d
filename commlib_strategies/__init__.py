"""Parallel training schemes (DP, ZeRO, TP, PP, SP/CP, MoE/EP) built on commlib's collectives."""
