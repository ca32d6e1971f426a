"""OLMo-core checkpoints, read and written without torch.

:mod:`~olmax.interop.olmo_core.pickles` (restricted unpickling, pickle writing),
:mod:`~olmax.interop.olmo_core.torch_zip` (``torch.save`` archives),
:mod:`~olmax.interop.olmo_core.dcp` (torch.distributed.checkpoint folders),
:mod:`~olmax.interop.olmo_core.checkpoint` (an OLMo-core ``step<N>/`` folder) and
:mod:`~olmax.interop.olmo_core.convert` (to and from olmax checkpoints).
"""
