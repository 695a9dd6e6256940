"""What the ops share: state capture requests and destinations (:mod:`.capture`) and the
Triton helpers for states that live in pages (:mod:`.triton`, imports ``triton``)."""
