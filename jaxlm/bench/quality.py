"""Quality of a model against another on the same weights: next-token distributions over a
fixed text of prose, code and arithmetic (`QUALITY_TEXT`), compared by `divergence`."""

from __future__ import annotations

import numpy as np

QUALITY_TEXT = """\
The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night,
its keeper climbed the narrow stairs, trimmed the wick and watched the ships pass in the dark.
When the storm came in November, the waves rose higher than anyone in the village remembered,
and the light was the only thing that did not move.

def merge_sorted(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out + a[i:] + b[j:]

Question: A train leaves at 9:15 and arrives at 11:40. How long is the journey?
Answer: From 9:15 to 11:15 is 2 hours, and from 11:15 to 11:40 is 25 minutes, so the journey
takes 2 hours and 25 minutes. If the ticket costs 18 euros and a return costs 1.5 times as
much, the return ticket costs 27 euros.

Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. The reaction
happens in the chloroplasts, where chlorophyll absorbs mostly red and blue light and reflects
green, which is why leaves look green to us.

SELECT name, COUNT(*) AS orders FROM customers JOIN orders ON customers.id = orders.customer_id
GROUP BY name HAVING COUNT(*) > 3 ORDER BY orders DESC;

12 * 7 = 84, 144 / 12 = 12, 2 ** 10 = 1024, and the square root of 169 is 13.
"""


def divergence(reference: np.ndarray, logits: np.ndarray) -> tuple[float, float]:
    """Mean KL(reference || logits) over the positions, and the top-1 agreement."""

    def log_softmax(x):
        x = np.asarray(x, np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    ref, got = log_softmax(reference), log_softmax(logits)
    kld = np.sum(np.exp(ref) * (ref - got), axis=-1)
    top = np.argmax(reference, -1) == np.argmax(logits, -1)
    return float(np.mean(kld)), float(np.mean(top))
