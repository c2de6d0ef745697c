"""Evaluation of generated answers: number extraction and regression-style metrics."""

from .numbers import extract_number, number_metrics

__all__ = ["extract_number", "number_metrics"]
