// The cluster config: the shipped deploy/cluster.json is valid and equals the
// defaults; every bad key or value is refused naming it.
#include <catch2/catch.hpp>

#include "config/cluster_config.h"

using pd::ClusterConfig;

TEST_CASE("config: deploy/cluster.json parses and documents exactly the defaults", "[config]") {
  auto c = ClusterConfig::load(std::string(PD_SOURCE_DIR) + "/deploy/cluster.json");
  INFO(c.status().to_string());
  REQUIRE(c.is_ok());
  const ClusterConfig d;
  CHECK(c->model == d.model);
  CHECK(c->http.port == d.http.port);
  CHECK(c->http.host == d.http.host);
  CHECK(c->engine.int8_activations == d.engine.int8_activations);
  CHECK(c->kv.block_size == d.kv.block_size);
  CHECK(c->kv.decode_budget_mb == d.kv.decode_budget_mb);
  CHECK(c->kv.prefill_budget_mb == d.kv.prefill_budget_mb);
  CHECK(c->prefill.token_budget == d.prefill.token_budget);
  CHECK(c->prefill.max_batch == d.prefill.max_batch);
  CHECK(c->decode.max_running == d.decode.max_running);
  CHECK(c->router.max_queued == d.router.max_queued);
  CHECK(c->router.max_inflight_per_worker == d.router.max_inflight_per_worker);
  CHECK(c->timeouts.handoff_ms == d.timeouts.handoff_ms);
  CHECK(c->timeouts.transfer_ms == d.timeouts.transfer_ms);
  CHECK(c->timeouts.drain_ms == d.timeouts.drain_ms);
  CHECK(c->model_name() == "SmolLM2-135M-Instruct.Q4_1");
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
  CHECK(err(R"({"modle": "x"})").find("'modle'") != std::string::npos);
  CHECK(err(R"({"kv": {"block_sise": 16}})").find("'kv.block_sise'") != std::string::npos);
  CHECK(err(R"({"kv": {"block_size": "16"}})").find("'kv.block_size' has the wrong type") != std::string::npos);
  CHECK(err(R"({"kv": {"block_size": 0}})").find("'kv.block_size' = 0 is out of range") != std::string::npos);
  CHECK(err(R"({"http": {"port": 70000}})").find("'http.port'") != std::string::npos);
  CHECK(err(R"({"timeouts": {"transfer_ms": 0}})").find("'timeouts.transfer_ms'") != std::string::npos);
  CHECK(err(R"({"decode": 3})").find("'decode' must be an object") != std::string::npos);
  CHECK(err(R"({"engine": {"int8_activations": 1}})").find("'engine.int8_activations' has the wrong type") !=
        std::string::npos);
  auto ok = ClusterConfig::parse(R"({"kv": {"block_size": 32}, "served_model_name": "m",
                                     "engine": {"int8_activations": false}})");
  REQUIRE(ok.is_ok());
  CHECK(ok->kv.block_size == 32);
  CHECK(!ok->engine.int8_activations);
  CHECK(ok->model_name() == "m");
  CHECK(ClusterConfig::load("/nonexistent/cluster.json").status().is_io_error());
}
