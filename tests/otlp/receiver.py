#!/usr/bin/env python3
"""An OTLP/HTTP traces receiver for tests and benches.

Each POST to /v1/traces is decoded with the OpenTelemetry project's own
protobuf definitions (PyPI `opentelemetry-proto`) and written to OUT as
one JSON line per span. Anything that does not decode is answered 400 and
recorded as an error line, so a test sees it.

  receiver.py --out FILE --port-file FILE [--sleep SECONDS]

--sleep answers every export that much later: a slow collector.
"""
import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

lock = threading.Lock()


def value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def attributes(kvs):
    return {kv.key: value(kv.value) for kv in kvs}


def spans(request):
    for resource_spans in request.resource_spans:
        resource = attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                yield {
                    "trace_id": s.trace_id.hex(),
                    "span_id": s.span_id.hex(),
                    "parent_span_id": s.parent_span_id.hex(),
                    "name": s.name,
                    "kind": s.kind,
                    "start": s.start_time_unix_nano,
                    "end": s.end_time_unix_nano,
                    "attributes": attributes(s.attributes),
                    "links": [{"trace_id": l.trace_id.hex(), "span_id": l.span_id.hex()} for l in s.links],
                    "status": s.status.code,
                    "status_message": s.status.message,
                    "resource": resource,
                    "scope": scope_spans.scope.name,
                }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_):
            pass

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            try:
                if self.path != "/v1/traces":
                    raise ValueError(f"path {self.path}")
                if self.headers.get("Content-Type") != "application/x-protobuf":
                    raise ValueError(f"content type {self.headers.get('Content-Type')}")
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                lines = [json.dumps(s) for s in spans(request)]
                headers = {k.lower(): v for k, v in self.headers.items() if k.lower().startswith("x-")}
            except Exception as e:  # noqa: BLE001 - any failure is the test's to see
                with lock, open(args.out, "a") as out:
                    out.write(json.dumps({"error": str(e)}) + "\n")
                self.send_response(400)
                self.end_headers()
                return
            if args.sleep:
                time.sleep(args.sleep)
            with lock, open(args.out, "a") as out:
                for line in lines:
                    out.write(line[:-1] + f', "headers": {json.dumps(headers)}}}\n')
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    with open(args.port_file + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))

    os.replace(args.port_file + ".tmp", args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
