//! Fault injection on the real binary (`--features failpoints`; issue 16,
//! "Nothing lost, nothing answered twice"): each test arms fail points in
//! the node through `FAILPOINTS` and checks every request still gets
//! exactly one answer.

use super::support::{Client, embedded_node_with_http, sample, scrape};
use crate::{digits_request, heldout};
use serde_json::json;

/// Issue 16, findings 12 and 5: an inference thread that panics answers its
/// batch `internal`, is counted, and goes on (with one thread per model it
/// used to leave the model answering `internal` for ever); a request whose
/// pipeline panics gets an `internal` reply (it used to be acknowledged
/// with no reply at all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_inference_thread_panics_on_a_marked_input_keeps_answering_the_others() {
    // A raw pixel of -3 is -0.1875 after the model's scale (1/16).
    let env = [
        ("EDGEINFER_RUNTIME__THREADS_PER_MODEL", "1"),
        ("FAILPOINTS", "inference_panic=return(digits:-0.1875);request_panic=return(boom)"),
    ];
    let (_node, port, http_port) = tokio::task::block_in_place(|| embedded_node_with_http("gw-p1", &env));
    let mut client = Client::connect(port, "dev-p1", &["dev/p1/replies"]).await;
    let split = heldout();
    for (round, (label, pixels)) in split.iter().take(3).enumerate() {
        let mut marked = pixels.clone();
        marked[0] = -3.0;
        for (id, pixels) in [(format!("marked-{round}"), marked), (format!("good-{round}"), pixels.clone())] {
            let mut req = digits_request(&id, &[pixels]);
            req["parameters"] = json!({"cache": false});
            let payload = req.to_string().into_bytes();
            client
                .request("edgeinfer/gw-p1/infer/digits", payload, "dev/p1/replies", id.as_bytes(), None)
                .await;
            let (_, reply) = client.next_json().await;
            assert_eq!(reply["id"], id.as_str(), "{reply}");
            if id.starts_with("marked") {
                assert_eq!(reply["parameters"]["code"], "internal", "{reply}");
            } else {
                assert_eq!(reply["parameters"]["label"], label.to_string(), "{reply}");
            }
        }
    }
    for id in ["boom", "after-boom"] {
        let mut req = digits_request(id, &[split[0].1.clone()]);
        req["parameters"] = json!({"cache": false});
        let payload = req.to_string().into_bytes();
        client.request("edgeinfer/gw-p1/infer/digits", payload, "dev/p1/replies", id.as_bytes(), None).await;
        let (_, reply) = client.next_json().await;
        assert_eq!(reply["id"], id, "{reply}");
        let expected = if id == "boom" { json!("internal") } else { json!(null) };
        assert_eq!(reply["parameters"]["code"], expected, "{reply}");
    }
    let metrics = tokio::task::block_in_place(|| scrape(http_port));
    assert_eq!(sample(&metrics, &["edgeinfer_inference_panics_total{", "model=\"digits\""]), 3.0);
    assert_eq!(sample(&metrics, &["edgeinfer_request_panics_total{", "model=\"digits\""]), 1.0);
}
