"""The precision policy and the rules that fill it: dtypes, flags, module groups,
group/keep/diffusion rules, metadata keys."""
