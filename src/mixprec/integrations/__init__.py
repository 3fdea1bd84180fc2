"""mixprec inside other training frameworks (faces: they call the core, the core never them).

`mixprec.integrations.lightning.MixprecPrecision` needs the optional `lightning` package.
"""
