"""Kernels: plain-torch references (`reference`), launchers (`ops`), compiled CPU kernels (`cpu`)."""
