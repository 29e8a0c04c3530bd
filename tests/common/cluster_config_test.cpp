// The cluster config: the shipped deploy/cluster.json is valid and equals the
// defaults; every bad key or value is refused naming it.
#include <catch2/catch.hpp>

#include "config/cluster_config.h"
#include "tokenizer/tokenizer.h"

using pd::ClusterConfig;

TEST_CASE("config: deploy/cluster.json parses and documents exactly the defaults", "[config]") {
  auto c = ClusterConfig::load(std::string(PD_SOURCE_DIR) + "/deploy/cluster.json");
  INFO(c.status().to_string());
  REQUIRE(c.is_ok());
  const ClusterConfig d;
  CHECK(c->model == d.model);
  CHECK(c->chat_template == d.chat_template);
  CHECK(c->http.port == d.http.port);
  CHECK(c->http.host == d.http.host);
  CHECK(c->http.max_connections == d.http.max_connections);
  CHECK(c->http.max_header_bytes == d.http.max_header_bytes);
  CHECK(c->http.metrics_require_key == d.http.metrics_require_key);
  CHECK(c->http.port_file == d.http.port_file);
  CHECK(c->http.allowed_origins == d.http.allowed_origins);
  CHECK(c->engine.int8_activations == d.engine.int8_activations);
  CHECK(c->kv.block_size == d.kv.block_size);
  CHECK(c->kv.decode_budget_mb == d.kv.decode_budget_mb);
  CHECK(c->kv.prefill_budget_mb == d.kv.prefill_budget_mb);
  CHECK(c->prefill.token_budget == d.prefill.token_budget);
  CHECK(c->prefill.max_batch == d.prefill.max_batch);
  CHECK(c->prefill.chunk_tokens == d.prefill.chunk_tokens);
  CHECK(c->prefill.context_cost_tokens == d.prefill.context_cost_tokens);
  CHECK(c->decode.max_running == d.decode.max_running);
  CHECK(c->decode.step_tokens == d.decode.step_tokens);
  CHECK(c->router.max_queued == d.router.max_queued);
  CHECK(c->router.max_inflight_per_worker == d.router.max_inflight_per_worker);
  CHECK(c->router.policy == d.router.policy);
  CHECK(c->router.queue_weight == d.router.queue_weight);
  CHECK(c->router.balance_ratio == d.router.balance_ratio);
  CHECK(c->router.balance_tokens == d.router.balance_tokens);
  CHECK(c->router.min_cached_fraction == d.router.min_cached_fraction);
  CHECK(c->router.decode_reuse_tokens == d.router.decode_reuse_tokens);
  CHECK(c->router.decode_reuse_weight == d.router.decode_reuse_weight);
  CHECK(c->router.warm_prefill == d.router.warm_prefill);
  CHECK(c->kv.prefix_cache == d.kv.prefix_cache);
  CHECK(c->timeouts.handoff_ms == d.timeouts.handoff_ms);
  CHECK(c->timeouts.transfer_ms == d.timeouts.transfer_ms);
  CHECK(c->timeouts.prefill_queue_ms == d.timeouts.prefill_queue_ms);
  CHECK(c->timeouts.stop_grace_ms == d.timeouts.stop_grace_ms);
  CHECK(c->timeouts.rank_drain_ms == d.timeouts.rank_drain_ms);
  CHECK(c->warnings.empty());  // the shipped file uses no deprecated key
  CHECK(c->model_name() == "SmolLM2-135M-Instruct.Q4_1");
  // The one deliberate difference: the shipped file sets the default model card's
  // sampling recommendation; the code's defaults are OpenAI's.
  CHECK(c->sampling.temperature == 0.2);
  CHECK(c->sampling.top_p == 0.9);
  CHECK(c->sampling.top_k == d.sampling.top_k);
  CHECK(c->sampling.min_p == d.sampling.min_p);
  CHECK(d.sampling.temperature == 1.0);
  CHECK(d.sampling.top_p == 1.0);
}

TEST_CASE("config: bad keys and values are refused naming them", "[config]") {
  auto err = [](const std::string& text) {
    auto c = ClusterConfig::parse(text);
    REQUIRE(!c.is_ok());
    CHECK(c.status().is_invalid_argument());
    return c.status().message();
  };
  CHECK(err("{not json").find("invalid JSON") != std::string::npos);
  CHECK(err("[]").find("top level") != std::string::npos);
  CHECK(err(R"({"chat_template": "mistral"})").find("'chat_template' = \"mistral\"") != std::string::npos);
  CHECK(err(R"({"chat_template": 1})").find("'chat_template' has the wrong type") != std::string::npos);
  CHECK(err(R"({"modle": "x"})").find("'modle'") != std::string::npos);
  CHECK(err(R"({"kv": {"block_sise": 16}})").find("'kv.block_sise'") != std::string::npos);
  CHECK(err(R"({"kv": {"block_size": "16"}})").find("'kv.block_size' has the wrong type") != std::string::npos);
  CHECK(err(R"({"kv": {"block_size": 0}})").find("'kv.block_size' = 0 is out of range") != std::string::npos);
  CHECK(err(R"({"http": {"port": 70000}})").find("'http.port'") != std::string::npos);
  CHECK(err(R"({"timeouts": {"transfer_ms": 0}})").find("'timeouts.transfer_ms'") != std::string::npos);
  CHECK(err(R"({"decode": 3})").find("'decode' must be an object") != std::string::npos);
  CHECK(err(R"({"prefill": {"chunk_tokens": -1}})").find("'prefill.chunk_tokens' = -1 is out of range") !=
        std::string::npos);
  CHECK(err(R"({"prefill": {"context_cost_tokens": -5}})").find("'prefill.context_cost_tokens'") != std::string::npos);
  CHECK(err(R"({"decode": {"step_tokens": 0}})").find("'decode.step_tokens' = 0 is out of range") != std::string::npos);
  CHECK(err(R"({"engine": {"int8_activations": 1}})").find("'engine.int8_activations' has the wrong type") !=
        std::string::npos);
  CHECK(err(R"({"sampling": {"temperature": 2.5}})").find("'sampling.temperature'") != std::string::npos);
  CHECK(err(R"({"sampling": {"top_p": 0}})").find("'sampling.top_p'") != std::string::npos);
  CHECK(err(R"({"sampling": {"top_k": -2}})").find("'sampling.top_k'") != std::string::npos);
  CHECK(err(R"({"sampling": {"min_p": "x"}})").find("'sampling.min_p' has the wrong type") != std::string::npos);
  CHECK(err(R"({"sampling": {"seed": 1}})").find("'sampling.seed'") != std::string::npos);
  CHECK(err(R"({"engine": {"backend": "tpu"}})").find("'engine.backend' = \"tpu\"") != std::string::npos);
  CHECK(err(R"({"engine": {"devices": 0}})").find("'engine.devices' must be an array") != std::string::npos);
  CHECK(err(R"({"engine": {"devices": [0, -1]}})").find("'engine.devices' holds -1") != std::string::npos);
  CHECK(err(R"({"engine": {"devices": ["0"]}})").find("'engine.devices' holds \"0\"") != std::string::npos);
  CHECK(err(R"({"router": {"policy": "random"}})").find("'router.policy' = \"random\"") != std::string::npos);
  CHECK(err(R"({"router": {"balance_ratio": 0.5}})").find("'router.balance_ratio'") != std::string::npos);
  CHECK(err(R"({"router": {"min_cached_fraction": 1.5}})").find("'router.min_cached_fraction'") != std::string::npos);
  CHECK(err(R"({"router": {"decode_reuse_tokens": -1}})").find("'router.decode_reuse_tokens'") != std::string::npos);
  CHECK(err(R"({"router": {"queue_weight": -1}})").find("'router.queue_weight'") != std::string::npos);
  CHECK(err(R"({"router": {"decode_reuse_weight": 0}})").find("'router.decode_reuse_weight'") != std::string::npos);
  CHECK(err(R"({"kv": {"prefix_cache": 1}})").find("'kv.prefix_cache' has the wrong type") != std::string::npos);
  auto ok = ClusterConfig::parse(R"({"kv": {"block_size": 32}, "served_model_name": "m",
                                     "engine": {"int8_activations": false, "backend": "cuda", "devices": [1, 0]}})");
  REQUIRE(ok.is_ok());
  CHECK(ok->engine.backend == "cuda");
  CHECK(ok->engine.devices == std::vector<int>{1, 0});
  // Node-local ranks take the listed devices in turn; without a list, local rank modulo the count.
  CHECK(ok->engine.device_of(0, 8) == 1);
  CHECK(ok->engine.device_of(1, 8) == 0);
  CHECK(ok->engine.device_of(2, 8) == 1);
  ClusterConfig::EngineSection spread;
  CHECK(spread.device_of(0, 4) == 0);
  CHECK(spread.device_of(5, 4) == 1);
  CHECK(spread.device_of(3, 0) == 0);  // no device: the backend's creation says so
  CHECK(spread.device_of(-1, 4) == 0);
  CHECK(ok->kv.block_size == 32);
  CHECK(!ok->engine.int8_activations);
  CHECK(ok->model_name() == "m");
  CHECK(ClusterConfig::load("/nonexistent/cluster.json").status().is_io_error());
}

TEST_CASE("config: chat_template names a format or is empty", "[config]") {
  for (const char* name : {"", "chatml", "gemma", "llama3", "llama3.1", "hermes", "qwen2.5"}) {
    auto c = ClusterConfig::parse(std::string(R"({"chat_template": ")") + name + "\"}");
    INFO(name << ": " << c.status().to_string());
    REQUIRE(c.is_ok());
    CHECK(c->chat_template == name);
    // Every name the config accepts is one the chat template knows.
    if (*name) CHECK(pd::ChatTemplate::from_name(name).is_ok());
  }
}

TEST_CASE("config: numbers beyond their type are refused naming the key", "[config]") {
  auto err = [](const std::string& text) {
    INFO(text);
    auto c = ClusterConfig::parse(text);
    REQUIRE(!c.is_ok());
    CHECK(c.status().is_invalid_argument());
    return c.status().message();
  };
  // Beyond double range: nlohmann throws mid-parse; the key is still named.
  CHECK(err(R"({"timeouts": {"request_ms": 1e400}})").find("'timeouts.request_ms' is beyond the range of a double") !=
        std::string::npos);
  CHECK(err(R"({"kv": {"checksum": true}, "http": {"port": -1e400}})").find("'http.port'") != std::string::npos);
  CHECK(err(R"({"decode": {"max_running": 8}, "prefill": {"threads": 1E+999}})").find("'prefill.threads'") !=
        std::string::npos);
  CHECK(err(R"({"model": 1e400})").find("'model'") != std::string::npos);
  // A float for an integer key, however large, is the wrong type.
  CHECK(err(R"({"kv": {"block_size": 1e300}})").find("'kv.block_size' has the wrong type (number, want an integer)") !=
        std::string::npos);
  CHECK(err(R"({"kv": {"decode_budget_mb": 16.0}})").find("'kv.decode_budget_mb' has the wrong type") !=
        std::string::npos);
  // An integer beyond the key's C++ type is refused, never wrapped (2^32 + 8000 is not port 8000).
  CHECK(err(R"({"http": {"port": 4294975296}})").find("'http.port' = 4294975296 is out of range") != std::string::npos);
  CHECK(err(R"({"router": {"max_queued": -4294967040}})").find("'router.max_queued' = -4294967040 is out of range") !=
        std::string::npos);
  CHECK(err(R"({"http": {"max_body_bytes": 18446744073709551615}})").find("'http.max_body_bytes' = 18446744073709551615 is out of range") !=
        std::string::npos);
  CHECK(err(R"({"timeouts": {"drain_ms": 9223372036854775807}})").find("'timeouts.drain_ms'") != std::string::npos);
  CHECK(err(R"({"http": {"max_body_bytes": 99999999999999999999}})").find("'http.max_body_bytes' has the wrong type") !=
        std::string::npos);  // beyond uint64: parsed as a float
}

TEST_CASE("config: the http and timeouts keys added for the router", "[config]") {
  auto ok = ClusterConfig::parse(R"({"http": {"metrics_require_key": true, "port_file": "/tmp/p", "port": 0,
                                              "max_connections": 10, "max_header_bytes": 4096},
                                     "timeouts": {"prefill_queue_ms": 5000}})");
  INFO(ok.status().to_string());
  REQUIRE(ok.is_ok());
  CHECK(ok->http.metrics_require_key);
  CHECK(ok->http.port_file == "/tmp/p");
  CHECK(ok->http.max_connections == 10);
  CHECK(ok->http.max_header_bytes == 4096);
  CHECK(ok->timeouts.prefill_queue_ms == 5000);
  const ClusterConfig d;
  CHECK_FALSE(d.http.metrics_require_key);
  auto bad = ClusterConfig::parse(R"({"http": {"metrics_require_key": 1}})");
  REQUIRE(!bad.is_ok());
  CHECK(bad.status().message().find("'http.metrics_require_key' has the wrong type") != std::string::npos);
  CHECK(ClusterConfig::parse(R"({"http": {"max_connections": 0}})").is_ok());  // 0 = unlimited
  CHECK(!ClusterConfig::parse(R"({"http": {"max_connections": -1}})").is_ok());
  CHECK(!ClusterConfig::parse(R"({"http": {"max_header_bytes": 10}})").is_ok());
  CHECK(!ClusterConfig::parse(R"({"timeouts": {"prefill_queue_ms": 0}})").is_ok());
  // A heartbeat deadline under the workers' 1 s report interval would take healthy ranks for dead.
  auto hb = ClusterConfig::parse(R"({"timeouts": {"heartbeat_ms": 3000}})");
  REQUIRE(hb.is_ok());
  CHECK(hb->timeouts.heartbeat_ms == 3000);
  CHECK(d.timeouts.heartbeat_ms == 5000);
  // Browser origins (CORS): "*", or origins as browsers send them.
  auto origins = ClusterConfig::parse(R"({"http": {"allowed_origins": ["https://a.example", "http://localhost:3000", "*"]}})");
  REQUIRE(origins.is_ok());
  CHECK(origins->http.allowed_origins == std::vector<std::string>{"https://a.example", "http://localhost:3000", "*"});
  CHECK(d.http.allowed_origins.empty());
  for (const char* v : {R"("*")", R"([1])", R"(["http://localhost:3000/"])", R"(["localhost:3000"])",
                        R"(["https://a.example/app"])", R"([""])"}) {
    INFO(v);
    auto refused = ClusterConfig::parse(std::string(R"({"http": {"allowed_origins": )") + v + "}}");
    REQUIRE(!refused.is_ok());
    CHECK(refused.status().message().find("http.allowed_origins") != std::string::npos);
  }
  auto short_hb = ClusterConfig::parse(R"({"timeouts": {"heartbeat_ms": 1000}})");
  REQUIRE(!short_hb.is_ok());
  CHECK(short_hb.status().message().find("timeouts.heartbeat_ms") != std::string::npos);
}

TEST_CASE("config: the router's stop grace and a rank's drain deadline are two keys", "[config]") {
  const ClusterConfig d;
  CHECK(d.timeouts.stop_grace_ms == 30000);
  CHECK(d.timeouts.rank_drain_ms == 30000);
  auto both = ClusterConfig::parse(R"({"timeouts": {"stop_grace_ms": 1000, "rank_drain_ms": 2000}})");
  INFO(both.status().to_string());
  REQUIRE(both.is_ok());
  CHECK(both->timeouts.stop_grace_ms == 1000);
  CHECK(both->timeouts.rank_drain_ms == 2000);
  CHECK(both->warnings.empty());
  auto grace = ClusterConfig::parse(R"({"timeouts": {"stop_grace_ms": 1000}})");
  REQUIRE(grace.is_ok());
  CHECK(grace->timeouts.stop_grace_ms == 1000);
  CHECK(grace->timeouts.rank_drain_ms == d.timeouts.rank_drain_ms);
  CHECK(!ClusterConfig::parse(R"({"timeouts": {"stop_grace_ms": 0}})").is_ok());
  auto bad = ClusterConfig::parse(R"({"timeouts": {"rank_drain_ms": 0}})");
  REQUIRE(!bad.is_ok());
  CHECK(bad.status().message().find("'timeouts.rank_drain_ms' = 0 is out of range") != std::string::npos);
}

TEST_CASE("config: the old timeouts.drain_ms still sets both, with a warning naming the new keys", "[config]") {
  auto old = ClusterConfig::parse(R"({"timeouts": {"drain_ms": 7000}})");
  INFO(old.status().to_string());
  REQUIRE(old.is_ok());
  CHECK(old->timeouts.stop_grace_ms == 7000);
  CHECK(old->timeouts.rank_drain_ms == 7000);
  REQUIRE(old->warnings.size() == 1);
  const std::string& w = old->warnings.front();
  CHECK(w.find("'timeouts.drain_ms' is deprecated") != std::string::npos);
  CHECK(w.find("'timeouts.stop_grace_ms'") != std::string::npos);
  CHECK(w.find("'timeouts.rank_drain_ms'") != std::string::npos);
  // A new key beside it wins for its own deadline, whatever the order in the file.
  for (const char* text : {R"({"timeouts": {"drain_ms": 7000, "rank_drain_ms": 500}})",
                           R"({"timeouts": {"rank_drain_ms": 500, "drain_ms": 7000}})"}) {
    auto mixed = ClusterConfig::parse(text);
    REQUIRE(mixed.is_ok());
    CHECK(mixed->timeouts.stop_grace_ms == 7000);
    CHECK(mixed->timeouts.rank_drain_ms == 500);
    CHECK(mixed->warnings.size() == 1);
  }
  auto wrong = ClusterConfig::parse(R"({"timeouts": {"drain_ms": "x"}})");
  REQUIRE(!wrong.is_ok());
  CHECK(wrong.status().message().find("'timeouts.drain_ms' has the wrong type") != std::string::npos);
}
