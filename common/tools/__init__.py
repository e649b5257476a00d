"""The commands (demo, bench, tune, compare) and their helpers.

Never imported by the library itself: ``import common`` and a call of
``attention()`` load nothing from here.
"""
