"""The report of a run, shared by the local lab and the cloud: the training's records, a run's
saved logs (a lab run's or a cluster's), what each fault cost, the text and the timeline plot.

It reads files only and imports neither ``lab.local`` nor ``lab.azure``."""
