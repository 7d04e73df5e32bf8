"""Formatting of numbers and markdown tables, and the JSON/CSV/markdown
writers of the benchmark scripts."""
import csv
import json
import math
from pathlib import Path
from typing import Dict, List


def fmt(v, digits=3) -> str:
    if v is None:
        return '-'
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return 'yes' if v else 'no'
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return 'nan'
        if v == 0:
            return '0'
        a = abs(v)
        if a >= 1000:
            return f'{v:,.0f}'
        if a >= 100:
            return f'{v:.1f}'
        if a >= 1:
            return f'{v:.{digits - 1}f}'
        if a >= 1e-3:
            return f'{v:.{digits}f}'
        return f'{v:.1e}'
    return str(v)


def fmt_count(n: int) -> str:
    """100000 -> '100k', 2000000 -> '2M'."""
    for div, suf in ((10**9, 'G'), (10**6, 'M'), (10**3, 'k')):
        if n >= div and n % (div // 10) == 0:
            v = n / div
            return f'{v:g}{suf}'
    return str(n)


def md_table(rows: List[dict], columns: List[tuple]) -> str:
    """``columns``: (header, key or callable(row))."""
    head = '| ' + ' | '.join(h for h, _ in columns) + ' |'
    sep = '|' + '|'.join('---' for _ in columns) + '|'
    lines = [head, sep]
    for r in rows:
        cells = []
        for _, k in columns:
            v = k(r) if callable(k) else r.get(k)
            cells.append(fmt(v).replace('|', '/'))
        lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def write_outputs(out_dir: Path, stem: str, meta: dict, records: List[dict],
                  markdown: str) -> Dict[str, str]:
    """``stem``.json (meta + records), ``stem``.csv (records, environment
    columns repeated on every row) and ``stem``.md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    p = out_dir / f'{stem}.json'
    with open(p, 'w') as f:
        json.dump({'meta': meta, 'results': records}, f, indent=1,
                  default=str)
    paths['json'] = str(p)
    env_cols = ['date', 'device_name', 'torch', 'torch_cuda', 'pyg', 'backend',
                'git']
    keys: List[str] = []
    for r in records:
        for k in r:
            if k not in keys:
                keys.append(k)
    p = out_dir / f'{stem}.csv'
    with open(p, 'w', newline='') as f:
        w = csv.writer(f)
        w.writerow(keys + env_cols)
        for r in records:
            w.writerow([r.get(k) for k in keys] + [meta.get(k) for k in env_cols])
    paths['csv'] = str(p)
    p = out_dir / f'{stem}.md'
    with open(p, 'w') as f:
        f.write(markdown if markdown.endswith('\n') else markdown + '\n')
    paths['md'] = str(p)
    return paths
