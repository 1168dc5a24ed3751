"""A run as it happens, for the local lab and the cloud alike: the job's live picture built
from the records as they arrive, the status line that shows it, and the event log of what
the lab did. May import ``lab.report``; imports neither ``lab.local`` nor ``lab.azure``."""
