import csv
import statistics
import sys


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def group_by(rows, column):
    groups = {}
    for row in rows:
        groups.setdefault(row[column], []).append(row)
    return groups


def column_values(rows, column):
    values = []
    for row in rows:
        value = row.get(column, "").strip()
        if value:
            values.append(float(value))
    return values


def summarize(rows, group_column, value_column):
    report = []
    for key, group in sorted(group_by(rows, group_column).items()):
        values = column_values(group, value_column)
        if not values:
            continue
        report.append({
            "group": key,
            "count": len(values),
            "mean": statistics.mean(values),
            "median": statistics.median(values),
            "max": max(values),
        })
    return report


def print_report(report, out=sys.stdout):
    out.write(f"{'group':<16}{'count':>8}{'mean':>12}{'median':>12}{'max':>12}\n")
    for line in report:
        out.write(f"{line['group']:<16}{line['count']:>8}{line['mean']:>12.2f}"
                  f"{line['median']:>12.2f}{line['max']:>12.2f}\n")


def main(argv):
    if len(argv) != 4:
        print("usage: csv_report.py FILE GROUP_COLUMN VALUE_COLUMN", file=sys.stderr)
        return 2
    rows = read_rows(argv[1])
    print_report(summarize(rows, argv[2], argv[3]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
