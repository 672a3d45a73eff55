"""File-system rules: paths (FileMapper), fd-relative safe access, O_DIRECT, trust of a root, temps, leases, deadlines.

Imports: errors, metrics; nothing else of tierstore (the floor every other package stands on).
"""
