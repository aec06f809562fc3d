"""Developer tools around ``kvservice bench`` that are not part of the product: they need a
checkout (``compare`` runs other versions of the package side by side) or instrument private
internals (``hops``).  The benchmark itself is ``kvservice.bench``."""
