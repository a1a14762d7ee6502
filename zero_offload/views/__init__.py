"""Parameters seen as flat buffers: what both ``optim`` and ``params`` build on.

``ParamViews`` binds a bucket's parameters to slots of one flat device buffer (``optim``
uses it as is, ``params.views.WindowedViews`` re-points it between a window slot and a
pinned home); ``Family`` is the set of parameters one run of buckets is planned from. This
package sits below both (it imports ``memory``, ``partition`` and ``accelerator`` only), so
the arrows between ``optim`` and ``params`` point one way.
"""

from .family import Family
from .param_views import ParamViews

__all__ = ["Family", "ParamViews"]
