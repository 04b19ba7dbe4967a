#!/usr/bin/env python3
"""An upload service's side of turnstile: publish a seller's products as one batch, then
follow every row's result and the batch's completion back (see README.md next to this file).

Prints one line per row as its result arrives, progress from the replica's HTTP API now and
then (--api), and last one JSON line `{"summary": {...}}`. Exits 0 once every row has a result
and the batch.completed event arrived, 1 on --timeout.
"""
import argparse
import csv
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

import pika


def read_products(args):
    if args.rows is not None:
        return [{"sku": f"SKU-{i:04d}", "title": f"Product {i}"} for i in range(1, args.rows + 1)]
    with open(args.file, newline="", encoding="utf-8-sig") as f:
        if args.file.lower().endswith(".csv"):
            return [row for row in csv.DictReader(f) if any(row.values())]
        products = [json.loads(line) for line in f if line.strip()]
    if not all(isinstance(p, dict) for p in products):
        sys.exit(f"{args.file}: every line must be a JSON object")
    return products


def batch_progress(args):
    """The batch as the replica's API sees it, or None (no --api, not known yet, unreachable)."""
    if not args.api:
        return None
    url = f"{args.api.rstrip('/')}/api/batches/{urllib.parse.quote(args.batch, safe='')}"
    request = urllib.request.Request(url)
    if args.api_token:
        request.add_header("Authorization", f"Bearer {args.api_token}")
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return json.load(response)
    except (OSError, ValueError):  # URLError/HTTPError (e.g. a 404 early on), bad JSON
        return None


def describe(result):
    """The product id the API gave a registered row, or why a row was not registered."""
    response = result.get("response")
    if result["outcome"] == "registered" and isinstance(response, dict):
        text = str(response.get("id", response))
    elif result.get("detail"):
        text = result["detail"]
    elif isinstance(response, dict):
        text = str(response.get("error") or response.get("message") or response)
    else:
        text = str(response or "")
    return text + (" (truncated)" if result.get("response_truncated") else "")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--amqp-url",
                   default=os.environ.get("TURNSTILE_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"))
    p.add_argument("--queue", default=os.environ.get("TURNSTILE_QUEUE", "registrations"))
    p.add_argument("--seller", default="S-1")
    p.add_argument("--batch", default=f"b-{uuid.uuid4().hex[:12]}")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--rows", type=int, help="publish N generated products")
    source.add_argument("--file", help="a .csv (header row) or .jsonl file of products")
    p.add_argument("--api", help="a replica's HTTP base URL, e.g. http://127.0.0.1:9464")
    p.add_argument("--api-token", default=os.environ.get("TURNSTILE_HTTP_TOKEN"))
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for the batch")
    args = p.parse_args()

    products = read_products(args)
    if not products:
        sys.exit("no products to publish")
    connection = pika.BlockingConnection(pika.URLParameters(args.amqp_url))
    channel = connection.channel()
    # One exclusive, server-named queue gets both our rows' results (as reply_to) and the
    # batch.completed events, bound before anything is published so that none is missed.
    inbox = channel.queue_declare("", exclusive=True).method.queue
    results_exchange = f"{args.queue}.results"
    try:
        channel.exchange_declare(results_exchange, passive=True)
    except pika.exceptions.ChannelClosedByBroker:
        sys.exit(f"no exchange {results_exchange!r}: start `turnstile consume` (TURNSTILE_QUEUE={args.queue}) first")
    channel.queue_bind(inbox, results_exchange, routing_key="batch.completed")

    channel.confirm_delivery()  # basic_publish now waits for the broker's confirm
    message_ids = {}  # message_id -> row
    for row, product in enumerate(products, start=1):
        message_id = f"{args.seller}:{args.batch}:{row}"  # stable: republishing registers nothing twice
        message_ids[message_id] = row
        body = {"message_id": message_id, "seller_id": args.seller, "batch_id": args.batch,
                "batch_size": len(products), "product": product}
        properties = pika.BasicProperties(content_type="application/json", delivery_mode=2,
                                          reply_to=inbox, correlation_id=str(row))
        try:  # mandatory: a missing work queue is an error, not a silent drop
            channel.basic_publish("", args.queue, json.dumps(body), properties, mandatory=True)
        except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as e:
            sys.exit(f"row {row} not accepted by the broker ({type(e).__name__}): is {args.queue!r} declared?")
    print(f"published {len(products)} rows of {args.seller} (batch {args.batch}) to {args.queue}", flush=True)

    results, duplicates, completed, progress = {}, 0, None, None
    deadline = time.monotonic() + args.timeout
    next_poll = time.monotonic()
    for method, _properties, body in channel.consume(inbox, auto_ack=True, inactivity_timeout=0.5):
        if method is not None:
            message = json.loads(body)
            if method.routing_key == "batch.completed":
                if (message.get("batch_id"), message.get("seller_id")) == (args.batch, args.seller):
                    completed = message
                    dead = ", ".join(f"{n} {reason}" for reason, n in sorted(message["dead"].items()))
                    print(f"batch {args.batch} completed: {message['registered']} of {message['total']} "
                          f"registered" + (f", dead: {dead}" if dead else ""), flush=True)
            elif message.get("message_id") in message_ids:
                row = message_ids[message["message_id"]]  # also int(_properties.correlation_id)
                if row in results:
                    duplicates += 1  # results come at least once: keep the first
                else:
                    results[row] = dict(message, row=row)
                    status = message.get("status") or "-"
                    print(f"row {row:>5}  {message['outcome']:<20} {status:>3}  {describe(message)}", flush=True)
        if completed and len(results) == len(products):
            break
        if time.monotonic() >= deadline:
            break
        if args.api and time.monotonic() >= next_poll:
            next_poll = time.monotonic() + 2
            progress = batch_progress(args) or progress
            if progress and not progress.get("done"):
                dead, eta = sum(progress.get("dead", {}).values()), progress.get("eta_s")
                print(f"progress: {progress.get('registered')} registered, {dead} dead, "
                      f"{progress.get('waiting')} waiting of {progress.get('total')}"
                      + (f", eta {eta:.1f}s" if eta is not None else ""), flush=True)
    channel.cancel()
    connection.close()

    complete = bool(completed) and len(results) == len(products)
    if not complete:
        missing = [row for row in range(1, len(products) + 1) if row not in results]
        print(f"timed out after {args.timeout:g}s: {len(missing)} rows without a result"
              + ("" if completed else ", no batch.completed event"), file=sys.stderr)
    print(json.dumps({"summary": {
        "batch_id": args.batch, "seller_id": args.seller, "rows": len(products), "complete": complete,
        "results": [results[row] for row in sorted(results)], "duplicates": duplicates,
        "completed": completed, "api": batch_progress(args)}}), flush=True)
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
