"""``lab prices``: what the GPU size costs at Spot and on demand, region by region, with each
region's eviction band. ``command.py`` is the command, ``report.py`` what it reports and
``table.py`` how it prints; ``retail.py`` (the Retail Prices API) and ``evictions.py`` (Resource
Graph's eviction bands) read Azure, through ``cache.py``."""
