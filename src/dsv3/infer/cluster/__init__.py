"""Serving over several processes: expert-parallel decode (``--ep``) and prefill/decode disaggregation
(``--prefill-ranks``). See ``serve.py`` for the entry point and ``lockstep.py`` for how the ranks' MoE
exchanges are matched."""
