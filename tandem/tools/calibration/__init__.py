"""Calibration for `policy="fluxion"`: Eq. 2 budgets measured on a model, Eq. 1 fits, streaming labels, the
head-property predictor and the profile file that holds them (Fluxion §5.2, Appendix A).

`profile.load_profile` reads a profile; `tandem calibrate` (`cli`) writes one."""
