"""The reference engine: every chapter's code, complete.

Learners work in `engine/`, which `python run.py skeleton` generates from this package by
replacing the body of every stub (a function whose docstring says "(Your engine: Chapter N)")
with a NotImplementedError. Modules import each other relatively, so any copy of this
package loads under any name.
"""
