"""reasonkv inside other tools. Each binding imports its tool, an optional extra, so import the binding itself:
``reasonkv.integrations.lm_eval`` (``pip install 'reasonkv[lm-eval]'``) is lm-evaluation-harness's ``reasonkv``
model. Importing this package imports none of them."""
